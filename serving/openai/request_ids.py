"""Every HTTP request gets an id, and a failure inside the server shows the client that id
and nothing else.

``RequestIdMiddleware`` (pure ASGI, so streams pass through untouched) draws the id, puts it in
``engine_run.REQUEST_ID`` for the request's handlers and in the answer's ``X-Request-Id``
header. An exception that escapes a route is logged with its traceback under that id and
answered with the OpenAI error body of an ``InternalError``: "internal error (request id ...)".
The exception's text stays in the log; it may hold user input or internals.
"""

from __future__ import annotations

import uuid

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.serving.openai.api_errors import REQUEST_ID, InternalError

__all__ = ["REQUEST_ID_HEADER", "RequestIdMiddleware"]

REQUEST_ID_HEADER = "X-Request-Id"


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        header = (REQUEST_ID_HEADER.lower().encode(), request_id.encode())
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        token = REQUEST_ID.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            error = InternalError(f"unhandled {type(exc).__name__} serving "
                                  f"{scope.get('method')} {scope.get('path')}")
            if started:  # too late for an answer: the server closes the connection
                raise
            await JSONResponse(error.body(), status_code=500)(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)
