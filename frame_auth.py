"""Authenticated control frames: an HMAC-SHA256 tag on every ZeroMQ frame, keyed per engine."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from pagedserve.messages import MessageDecodeError

__all__ = ["FrameAuth", "FrameAuthError"]


class FrameAuthError(MessageDecodeError):
    """A frame without the engine's valid authentication tag (a stranger's, or corrupted)."""


class FrameAuth:
    """HMAC-SHA256 over every part of a multipart frame, with one engine's secret.

    Only processes that were handed the secret (through Ray, by whoever started the engine)
    can make a frame the engine accepts: anything else that reaches a port is dropped. The tag
    is one extra part; parts are length-prefixed under it, so no two frames share a tag.
    """

    TAG_BYTES = 32

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) < 16:
            raise ValueError("a frame key is at least 16 random bytes")
        self.key = key

    @classmethod
    def new(cls) -> FrameAuth:
        return cls(secrets.token_bytes(32))

    def _tag(self, parts: list[bytes]) -> bytes:
        mac = hmac.new(self.key, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(len(part).to_bytes(8, "little"))
            mac.update(part)
        return mac.digest()

    def seal(self, parts: list[bytes]) -> list[bytes]:
        return [*parts, self._tag(parts)]

    def open(self, frames: list[bytes]) -> list[bytes]:
        """The parts of a sealed frame; ``FrameAuthError`` when its tag does not check."""
        if not frames or not hmac.compare_digest(frames[-1], self._tag(frames[:-1])):
            raise FrameAuthError("frame rejected: missing or wrong authentication tag")
        return frames[:-1]
