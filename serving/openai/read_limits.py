"""``BodyLimits``: an ASGI middleware bounding what a request body may cost while it is read.

* Size: a body whose ``Content-Length`` is over the limit is refused with 413 before the app
  sees any of it; one without (chunked) as soon as the bytes read pass the limit. A client that
  sent ``Expect: 100-continue`` has not sent its body and waits for leave to: it is answered at
  once, and never sends it. Otherwise the rest is read and dropped, never buffered, until it
  ends or the body timeout passes, and only then answered (the connection closed after): most
  clients send their whole body before they read the answer, and one cut off mid-upload sees a
  reset instead of the 413.
* Time: the whole body must arrive within the body timeout of the headers (408 past it): a
  client that sends a few bytes and stalls, or drips them, cannot hold the request open.

Both are raised from the app's ``receive`` as Starlette ``HTTPException``s: FastAPI passes
those through its body parsing (any other error there becomes a 400 "error parsing the body")
to the app's handler, which answers with the OpenAI error body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BodyLimits", "BodyTimeout", "BodyTooLarge"]


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than this server takes ({limit} "
                              "bytes; the server's --max-body-bytes)")


class BodyTimeout(HTTPException):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body did not arrive within {timeout_s:g} s (the "
                              "server's --body-timeout)")


class BodyLimits:
    """Bound every HTTP request body of ``app``: ``max_bytes`` (None: no limit; a path that
    starts with a key of ``path_limits`` gets that limit instead) and ``timeout_s`` (None:
    none)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int | None,
        timeout_s: float | None,
        path_limits: Mapping[str, int | None] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.path_limits = dict(path_limits or {})

    def _limit(self, path: str) -> int | None:
        for prefix, limit in self.path_limits.items():
            if path.startswith(prefix):
                return limit
        return self.max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self._limit(scope["path"])
        declared = _content_length(scope)
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout_s is None else loop.time() + self.timeout_s
        if limit is not None and declared is not None and declared > limit:
            if not _expects_continue(scope):  # the body is on its way: take it in first
                await _drain(receive, deadline)
            await _refuse(BodyTooLarge(limit))(scope, receive, send)
            return
        received = 0
        done = False

        async def bounded_receive() -> Message:
            nonlocal received, done
            if done:  # the body is in: only a disconnect can come now
                return await receive()
            if deadline is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), deadline - loop.time())
                except asyncio.TimeoutError:
                    assert self.timeout_s is not None
                    raise BodyTimeout(self.timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if limit is not None and received > limit:
                    if message.get("more_body", False):
                        await _drain(receive, deadline)
                    done = True
                    raise BodyTooLarge(limit)
                done = not message.get("more_body", False)
            else:
                done = True
            return message

        await self.app(scope, bounded_receive, send)


# How long a refused body is read and dropped when no body timeout bounds it.
_DRAIN_CAP_S = 30.0


async def _drain(receive: Receive, deadline: float | None) -> None:
    """Read and drop the rest of a refused body, until its end or ``deadline``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + _DRAIN_CAP_S if deadline is None else deadline
    while (left := end - loop.time()) > 0:
        try:
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


def _content_length(scope: Scope) -> int | None:
    value = Headers(scope=scope).get("content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None  # the server's HTTP parser refuses it


def _expects_continue(scope: Scope) -> bool:
    return Headers(scope=scope).get("expect", "").lower() == "100-continue"


def _refuse(exc: HTTPException) -> JSONResponse:
    body = {"error": {"message": exc.detail, "type": "invalid_request_error", "param": None,
                      "code": "request_too_large" if exc.status_code == 413 else "timeout"}}
    # The body may not have ended: the connection carries no other request after this one.
    return JSONResponse(body, status_code=exc.status_code, headers={"Connection": "close"})
