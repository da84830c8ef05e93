"""Typed errors raised by the KV block manager.

Every error is raised before any state is changed, so a caller that catches one can keep using
the manager as if the call had never happened (tests assert this with ``check_integrity``).
"""

from __future__ import annotations

__all__ = [
    "DoubleFreeError",
    "InvalidArgumentError",
    "KVCacheError",
    "RequestTooLargeError",
    "UnknownRequestError",
]


class KVCacheError(Exception):
    """Base class of every error raised by ``pagedserve.kv``."""


class InvalidArgumentError(KVCacheError, ValueError):
    """A caller passed a value that can never be valid (negative count, zero new tokens, ...)."""


class RequestTooLargeError(KVCacheError):
    """A request needs more blocks than the whole cache holds; it could never be scheduled."""


class UnknownRequestError(KVCacheError, KeyError):
    """The request id holds no blocks in this manager."""


class DoubleFreeError(KVCacheError):
    """A block or request was freed a second time."""
