"""The uvicorn server of ``serve``: its configuration, with a header read timeout.

uvicorn bounds only the idle time between requests on a kept-alive connection; a connection
that opens and sends nothing, or sends its headers a byte at a time, is held forever (#27).
``HeaderTimeoutH11`` closes a connection whose request headers are not complete within the
header timeout of its opening (or of the first byte of its next request), answering 408.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedserve.serving.openai.limits import ServerLimits

__all__ = ["header_timeout_protocol", "uvicorn_config"]

_TIMEOUT_TEXT = b"the request headers did not arrive in time"
_TIMED_OUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_TIMEOUT_TEXT), _TIMEOUT_TEXT)
)


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header read timeout of ``timeout_s``."""

    class HeaderTimeoutH11(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # IDLE on their side: the next request's headers are not complete yet.
            if self.conn.their_state is h11.IDLE and data:
                self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is None:  # the first byte starts the clock, not the last
                self._header_timer = self.loop.call_later(timeout_s, self._timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _timed_out(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.write(_TIMED_OUT)
                self.transport.close()

    return HeaderTimeoutH11


def uvicorn_config(app: Any, limits: ServerLimits, **options: Any) -> uvicorn.Config:
    """``uvicorn.Config`` for ``app`` under ``limits`` (``options``: host, port, log_level, ...).
    With a header timeout the h11 implementation is used (httptools has no such hook)."""
    if limits.header_timeout_s is not None:
        options["http"] = header_timeout_protocol(limits.header_timeout_s)
    return uvicorn.Config(app, **options)
