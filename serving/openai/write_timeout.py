"""``WriteTimeout``: an ASGI middleware that ends a response whose client stopped reading.

A write to a client that reads nothing waits once the socket's buffers are full, and with it
the stream's generator, its engine requests (still running, counted in flight) and every
output they produce meanwhile. Outermost, the middleware bounds each write to the server
itself, whatever layers sit between (the API-key check relays a stream through a task of its
own); past the timeout it leaves the response unfinished, which makes the server close the
connection, and the layers inside are unwound: the stream's ``finally`` aborts its requests
and drops what it had not sent.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["StalledWrite", "WriteTimeout"]

logger = logging.getLogger(__name__)


class StalledWrite(BaseException):
    """A write waited past the write timeout. A ``BaseException``, as cancellation is, so that
    no handler inside takes it for a failure of the request (and answers or logs a 500)."""


class WriteTimeout:
    def __init__(self, app: ASGIApp, timeout_s: float | None) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = self.timeout_s
        if scope["type"] != "http" or timeout is None:
            await self.app(scope, receive, send)
            return

        async def bounded_send(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), timeout)
            except asyncio.TimeoutError:
                raise StalledWrite() from None

        try:
            await self.app(scope, receive, bounded_send)
        except StalledWrite:
            logger.warning("%s: the client read nothing for %g s; its response is cut off",
                           scope.get("path"), timeout)
