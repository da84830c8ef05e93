"""The OpenAI-compatible HTTP server: FastAPI routes over an ``EngineClient``.

``build_app(client)`` makes the ASGI app (testable without a socket); ``serve(config, ...)``
starts an engine and runs the app under uvicorn until interrupted. Routes:
``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` and
``POST /v1/responses`` (``responses``: a chat completion in the Responses shape), each with
server-sent-event streaming, ``POST /tokenize`` and ``/detokenize`` (``tokenize_routes``),
the Batch API when a batch directory is given (``serving.batch_api``), ``GET /health``,
``GET /version`` and ``GET /metrics`` (Prometheus). With an API key every route but ``/health``
needs ``Authorization: Bearer <key>``. With allowed origins, browsers on those origins may call
it (CORS, preflight answered before the key is checked). Every error answers with the OpenAI
error body ``{"error": {"message", "type", "param", "code"}}``; a 500 says only "internal
error" and the request id, which every answer carries in ``X-Request-Id`` (``request_ids``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from pagedserve.config import EngineConfig
from pagedserve.controller.client import EngineClient
from pagedserve.serving.openai.api_errors import APIError, validation_error
from pagedserve.serving.openai.cpu_pool import CpuPool
from pagedserve.serving.openai.endpoint import Endpoint
from pagedserve.serving.openai.engine_run import ClientGone, EngineRun, ServerContext
from pagedserve.serving.openai.json_turns import JSONInTurns
from pagedserve.serving.openai.limits import ServerLimits
from pagedserve.serving.openai.metrics import ServerMetrics
from pagedserve.serving.openai.prepare import prepare_chat, prepare_completion, warm_chat_template
from pagedserve.serving.openai.protocol import (
    ERROR_RESPONSES,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from pagedserve.serving.openai.read_limits import BodyLimits
from pagedserve.serving.openai.render import render_json
from pagedserve.serving.openai.request_ids import RequestIdMiddleware
from pagedserve.serving.openai.responses import ResponsesEndpoint, prepare_responses
from pagedserve.serving.openai.responses_protocol import ResponsesRequest
from pagedserve.serving.openai.tokenize_routes import tokenize_router
from pagedserve.serving.openai.write_timeout import WriteTimeout
from pagedserve.serving.reasoning_parsers import REASONING_PARSERS
from pagedserve.serving.tool_parsers import tool_call_format

__all__ = ["build_app", "serve"]

logger = logging.getLogger(__name__)

UNPROTECTED_PATHS = frozenset({"/health"})
try:
    _VERSION = package_version("pagedserve")
except PackageNotFoundError:  # run from a checkout that was never installed
    _VERSION = "unknown"


class _EngineStream(StreamingResponse):
    """A server-sent-event stream that aborts its engine requests however it ends.

    Starlette cancels the body when the client disconnects, and ``WriteTimeout`` unwinds it
    when the client stops reading; the ``finally`` then aborts the requests still running, so
    their KV blocks are freed at once, and drops the output not yet sent.
    """

    def __init__(self, content: Any, run: EngineRun, on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._run = run
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._run.close()
            self._on_close()


# The answers of read_limits (a body too slow or too large), as its own refusals code them.
_READ_LIMIT_CODES = {408: "timeout", 413: "request_too_large"}


def _error(exc: APIError) -> JSONResponse:
    headers = None if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


_ANSWERS: dict[int | str, dict[str, Any]] = {
    200: {"description": "the completion, or a stream of server-sent events",
          "content": {"application/json": {}, "text/event-stream": {}}},
    499: {"description": "the client went away before the answer", "content": None},
    **ERROR_RESPONSES,
}


@contextlib.asynccontextmanager
async def _warm_event_loop(_: FastAPI) -> AsyncIterator[None]:
    """Before the server accepts a connection: anyio imports its asyncio backend on first use,
    which is the first streamed answer's task group. That import (hundreds of ms without
    byte-compiled files, and holding the GIL the in-process engine's thread needs) would
    otherwise land on the first request."""
    await anyio.sleep(0)
    yield


def build_app(
    client: EngineClient,
    *,
    api_key: str | None = None,
    batch_dir: str | os.PathLike[str] | None = None,
    batch_max_in_flight: int = 4,
    limits: ServerLimits | None = None,
    allow_special_tokens_in_content: bool = False,
    allowed_origins: Sequence[str] = (),
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The ASGI app serving ``client``. Metrics live in a registry owned by this app.

    With ``batch_dir`` the Batch API (``/v1/files``, ``/v1/batches``) keeps its state there
    and its runner starts at once, resuming unfinished batches; ``app.state.batches.close()``
    stops it (``serve`` does). ``limits`` (None: the defaults) bound what one request may
    cost; ``app.state.context.pool.close()`` stops its CPU threads (``serve`` does).
    Control-token text in chat messages (``</s>``) is tokenized as text unless
    ``allow_special_tokens_in_content``. ``allowed_origins`` (``*`` for any) may call it
    from a browser. ``tool_call_parser`` reads the calls of ``tool_choice`` auto (None: the
    one the chat template's syntax shows); ``reasoning_parser`` splits a thinking model's
    reasoning off its chat answers (``reasoning_content``).
    """
    limits = ServerLimits() if limits is None else limits
    if tool_call_parser is not None:
        tool_call_format(tool_call_parser)  # an unknown name fails here, not per request
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    app = FastAPI(title="pagedserve", summary="OpenAI-compatible server over pagedserve",
                  lifespan=_warm_event_loop)
    app.router.route_class = JSONInTurns
    app.state.json_turn = asyncio.Lock()
    metrics = ServerMetrics(client)
    ctx = ServerContext(client, metrics, limits=limits, pool=CpuPool(limits.cpu_workers),
                        allow_special_tokens_in_content=allow_special_tokens_in_content,
                        tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser)
    app.state.client = client
    app.state.metrics = metrics
    app.state.context = ctx
    metrics.interactive_in_flight.set_function(lambda: ctx.interactive.count)
    warm_chat_template(client)

    # ------------------------------------------------------------------------- errors
    @app.exception_handler(APIError)
    async def _on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = _READ_LIMIT_CODES.get(exc.status_code)
        resp = _error(APIError(exc.status_code, str(exc.detail), type=kind, code=code))
        if code is not None:  # the body was not read to its end: no next request on it
            resp.headers["Connection"] = "close"
        return resp

    # ----------------------------------------------------------------------- auth
    if api_key is not None:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def _check_key(
            request: Request, call_next: Callable[[Request], Awaitable[Response]]
        ) -> Response:
            if request.url.path not in UNPROTECTED_PATHS:
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    return _error(APIError(
                        401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                        code="invalid_api_key",
                    ))
            return await call_next(request)

    # Outside the key check: a browser's preflight carries no key.
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["X-Request-Id"])
    # Outermost, so that every answer carries the id (401s too) and any exception is caught.
    app.add_middleware(RequestIdMiddleware)

    # ----------------------------------------------------------------------- routes
    # Every status a route can answer is in the OpenAPI schema, with its real media type.
    @app.get("/health", response_class=Response, responses={
        200: {"description": "the engine serves", "content": None},
        503: {"description": "the engine is down, or the Batch API's runner died past its "
                             "restarts", "content": None},
    })
    async def health() -> Response:
        try:
            healthy = client.is_healthy()
        except Exception:
            healthy = False
        runner = app.state.batches
        if runner is not None and not runner.alive:
            healthy = False
        return Response(status_code=200 if healthy else 503)

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus metrics", "content": {CONTENT_TYPE_LATEST: {}}},
    })
    async def prometheus() -> Response:
        # stats() of a remote engine is a round trip: keep it off the event loop.
        body = await asyncio.to_thread(metrics.render)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _VERSION}

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models() -> dict[str, Any]:
        card = ModelCard(
            id=client.model_name, root=client.model_name, max_model_len=client.max_model_len
        )
        return ModelList(data=[card]).model_dump()

    @app.post("/v1/completions", responses=_ANSWERS)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await _interactive(ctx, prepare_completion(ctx, body), raw)

    @app.post("/v1/chat/completions", responses=_ANSWERS)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await _interactive(ctx, prepare_chat(ctx, body), raw)

    @app.post("/v1/responses", responses=_ANSWERS)
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        return await _interactive(ctx, prepare_responses(ctx, body), raw)

    app.include_router(tokenize_router(ctx))
    app.state.batches = None
    upload_limits: dict[str, int | None] = {}
    if batch_dir is not None:
        from pagedserve.serving.batch_api.routes import MAX_UPLOAD_BYTES, batch_router
        from pagedserve.serving.batch_api.runner import BatchRunner
        from pagedserve.serving.batch_api.store import BatchStore

        # An upload has its own limit, plus room for the multipart framing around the file.
        upload_limits["/v1/files"] = MAX_UPLOAD_BYTES + (1 << 20)

        runner = BatchRunner(BatchStore(batch_dir), ctx, max_in_flight=batch_max_in_flight)
        app.include_router(batch_router(runner))
        metrics.batch_in_flight.set_function(lambda: runner.in_flight)
        app.state.batches = runner
        runner.start()
    # Outermost (added last), so that a body over the limit is refused before anything reads
    # it, and every write to the server is bounded, whatever relays it.
    app.add_middleware(BodyLimits, max_bytes=limits.max_body_bytes,
                       timeout_s=limits.body_timeout_s, path_limits=upload_limits)
    app.add_middleware(WriteTimeout, timeout_s=limits.write_timeout_s)
    return app


async def _interactive(
    ctx: ServerContext, prepare: Awaitable[Endpoint | ResponsesEndpoint], raw: Request
) -> Response:
    """Answer one interactive call, counted in ``ctx.interactive`` until its answer is over
    (the batch runner holds its lines back meanwhile)."""
    ctx.interactive.enter()
    try:
        endpoint = await prepare
    except BaseException:
        ctx.interactive.exit()
        raise
    if endpoint.stream:
        return _EngineStream(endpoint.stream_events(), endpoint.run, ctx.interactive.exit)
    try:
        body = await endpoint.respond(raw.is_disconnected)
        rendered = await ctx.pool.run(render_json, body)  # a large answer is megabytes
    except ClientGone:
        return Response(status_code=499)
    finally:
        endpoint.run.abort()  # a no-op when everything finished
        ctx.interactive.exit()
    return Response(rendered, media_type="application/json")


def serve(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    *,
    backend: str | None = None,
    log_level: str = "info",
    batch_dir: str | os.PathLike[str] | None = None,
    batch_max_in_flight: int = 4,
    limits: ServerLimits | None = None,
    allow_special_tokens_in_content: bool = False,
    allowed_origins: Sequence[str] = (),
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> None:
    """Start an engine for ``config`` and serve it until interrupted, then shut it down.

    ``backend`` (``ray`` / ``local``) goes to ``builder.start_engine``; None takes its default.
    ``batch_dir`` holds the Batch API's files and batches (None: no Batch API). ``limits``
    (None: the defaults) bound requests, and give the server its header read timeout.
    """
    import uvicorn

    from pagedserve.builder import start_engine
    from pagedserve.serving.openai.http_server import uvicorn_config

    limits = ServerLimits() if limits is None else limits
    client = start_engine(config) if backend is None else start_engine(config, backend)
    app = None
    try:
        app = build_app(client, api_key=api_key, batch_dir=batch_dir,
                        batch_max_in_flight=batch_max_in_flight, limits=limits,
                        allow_special_tokens_in_content=allow_special_tokens_in_content,
                        allowed_origins=allowed_origins, tool_call_parser=tool_call_parser,
                        reasoning_parser=reasoning_parser)
        logger.info("serving %s on http://%s:%d", client.model_name, host, port)
        server = uvicorn.Server(uvicorn_config(app, limits, host=host, port=port,
                                               log_level=log_level))
        server.run()
    finally:
        if app is not None:
            if app.state.batches is not None:
                app.state.batches.close()  # in-flight lines are redone by the next start
            app.state.context.pool.close()
        client.shutdown()
