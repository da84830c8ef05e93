"""Typed errors for requests the engine refuses.

Every error is raised at admission, before the engine changes any state, so a caller that catches
``RequestError`` can carry on and the other requests are unaffected.
"""

from __future__ import annotations

from pagedserve.kv.errors import RequestTooLargeError as _KVRequestTooLargeError

__all__ = [
    "DuplicateRequestError",
    "EmptyPromptError",
    "InvalidTokenError",
    "PromptTooLongError",
    "RequestError",
    "RequestTooLargeError",
    "UnknownRequestError",
    "UnsupportedRequestError",
]


class RequestError(ValueError):
    """Base class: this request cannot be served as given."""


class EmptyPromptError(RequestError):
    """The prompt has no tokens; there is nothing to condition the first sample on."""


class PromptTooLongError(RequestError):
    """The prompt is longer than the model's context (``max_model_len``)."""


class InvalidTokenError(RequestError):
    """A prompt token id lies outside ``[0, vocab_size)``."""


class DuplicateRequestError(RequestError):
    """The request id is already in use by an unfinished request."""


class UnsupportedRequestError(RequestError):
    """The request asks for something this engine cannot do (e.g. stop strings without a
    tokenizer, or more parallel samples than ``max_num_seqs``)."""


class RequestTooLargeError(RequestError, _KVRequestTooLargeError):
    """Even alone, the request would need more KV blocks than the whole cache holds.

    Subclasses kv's error too, so ``except`` clauses written against either layer catch it.
    """


class UnknownRequestError(RequestError, KeyError):
    """No unfinished request has this id."""
