"""``EngineClient``: a thread-safe handle on a running engine loop, and the in-process one.

Front ends (the HTTP server, the batch job, ``LLM``) talk to an engine through this protocol
only, so the same front end runs on an ``EngineLoop`` in this process or on the Ray controller
actor behind ZeroMQ. Outputs are pushed: each request has a *sink* called with each of its
``RequestDelta``s, the last one having ``finished=True``; ``OutputAccumulator`` builds the
cumulative output for those who want it. Sinks run on a client thread and must not block; an
asyncio front end hands them to its loop with ``call_soon_threadsafe``.

``ClientBase`` holds what every client does alike (its requests' sinks, the verdicts of pending
adds, failing everything once the engine is gone); a client adds how messages travel.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from pagedserve.controller.errors import (
    ControllerLostError,
    DuplicateRequestError,
    EngineDeadError,
    error_from_code,
)
from pagedserve.controller.loop import EngineLoop
from pagedserve.controller.outputs import failed_delta
from pagedserve.controller.tokenizer import Tokenizer
from pagedserve.messages import AbortRequest, AddRequest, EngineStatus, OutputBatch, RequestDelta

__all__ = ["ClientBase", "EngineClient", "LocalEngineClient", "Sink"]

logger = logging.getLogger(__name__)

Sink = Callable[[RequestDelta], None]


class EngineClient(Protocol):
    """What a front end may call. Every method is safe from any thread.

    ``add_request`` waits for the engine's verdict and raises a ``RequestError`` subclass for
    bad input (nothing is queued then) or ``EngineDeadError`` when the engine is down;
    ``submit`` sends without waiting (adds pipeline) and its future raises the same.
    """

    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    tokenizer: Tokenizer | None

    def add_request(self, request: AddRequest, sink: Sink) -> None: ...

    def submit(self, request: AddRequest, sink: Sink) -> Future[None]: ...

    def wait_added(self, fut: Future[None]) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def is_healthy(self) -> bool: ...

    @property
    def error(self) -> str | None: ...

    def shutdown(self) -> None: ...


class ClientBase:
    """The request table of a client. Subclasses implement ``_post`` (send a command) and call
    ``_on_message`` with what the engine sends back, and ``_fail_all`` when it is gone."""

    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    tokenizer: Tokenizer | None

    def __init__(self, *, add_timeout_s: float = 120.0) -> None:
        self._add_timeout_s = add_timeout_s
        self._lock = threading.Lock()
        self._requests: dict[str, tuple[Sink, int]] = {}  # id -> (sink, n)
        self._adds: dict[str, deque[Future[None]]] = {}
        self._dead: str | None = None
        self._dead_error: type[EngineDeadError] = EngineDeadError

    def _post(self, msg: AddRequest | AbortRequest) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ EngineClient
    def add_request(self, request: AddRequest, sink: Sink) -> None:
        self.wait_added(self.submit(request, sink))

    def submit(self, request: AddRequest, sink: Sink) -> Future[None]:
        fut: Future[None] = Future()
        with self._lock:
            # Under the lock: a request registered after ``_fail_all`` would never hear of it.
            if self._dead is not None:
                raise self._dead_error(self._dead)
            if request.request_id in self._requests:
                raise DuplicateRequestError(
                    f"request id {request.request_id!r} is already in use"
                )
            self._requests[request.request_id] = (sink, request.params.n)
            self._adds.setdefault(request.request_id, deque()).append(fut)
        self._post(request)
        return fut

    def wait_added(self, fut: Future[None]) -> None:
        """Wait (bounded) for a submitted add's verdict; raises what ``add_request`` would."""
        deadline = time.monotonic() + self._add_timeout_s
        while True:
            try:
                fut.result(timeout=0.5)
                return
            except TimeoutError:
                if self._dead is not None:
                    raise self._dead_error(self._dead) from None
                if time.monotonic() > deadline:
                    raise EngineDeadError(
                        f"the engine did not answer an add within {self._add_timeout_s} s"
                    ) from None

    def abort_request(self, request_id: str) -> None:
        if self._dead is None:
            self._post(AbortRequest(request_id))

    @property
    def error(self) -> str | None:
        return self._dead

    @property
    def lost(self) -> bool:
        """The controller was found lost (its requests failed with ``ControllerLostError``): a
        new one may take them, unlike an engine that is dead."""
        return self._dead is not None and self._dead_error is ControllerLostError

    # ------------------------------------------------------------------ from the engine
    def _on_message(self, msg: OutputBatch | EngineStatus) -> None:
        if isinstance(msg, EngineStatus):
            if not msg.healthy:
                self._fail_all(msg.error or "the engine reported itself unhealthy")
            return
        for result in msg.results:
            with self._lock:
                futs = self._adds.get(result.request_id)
                fut = futs.popleft() if futs else None
                if futs is not None and not futs:
                    del self._adds[result.request_id]
                if result.error_type is not None:
                    self._requests.pop(result.request_id, None)
            if fut is None:
                continue
            if result.error_type is None:
                fut.set_result(None)
            else:
                fut.set_exception(error_from_code(result.error_type, result.error_message or ""))
        for delta in msg.outputs:
            entry = self._requests.get(delta.request_id)
            if entry is None:
                continue
            if delta.finished:
                with self._lock:
                    self._requests.pop(delta.request_id, None)
            _call(entry[0], delta)

    def _fail_all(self, reason: str, error: type[EngineDeadError] = EngineDeadError) -> None:
        """The engine is gone: every request ends with an error delta, every pending add and
        later submit raises ``error``. A ``ControllerLostError`` names itself in the deltas'
        ``error_code``, so that a front end can tell requests it may move elsewhere."""
        code = error.__name__ if error is not EngineDeadError else None
        with self._lock:
            if self._dead is None:
                self._dead = reason
                self._dead_error = error
            requests, self._requests = self._requests, {}
            adds, self._adds = self._adds, {}
        for futs in adds.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(error(reason))
        for request_id, (sink, n) in requests.items():
            _call(sink, failed_delta(request_id, list(range(n)), reason, code))


def _call(sink: Sink, delta: RequestDelta) -> None:
    try:
        sink(delta)
    except Exception:  # a broken front end must not take the client down
        logger.exception("output sink of request %s failed", delta.request_id)


class LocalEngineClient(ClientBase):
    """The in-process client: an ``EngineLoop`` on a thread of this process. Its sinks run on
    the loop thread. ``loop.engine`` is the core, for tests and diagnostics."""

    def __init__(self, loop: EngineLoop, model_name: str, **options: Any) -> None:
        super().__init__(**options)
        self.loop = loop
        engine = loop.engine
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.block_size = engine.kv.block_size
        self.tokenizer = engine.tokenizer

    @property
    def engine(self) -> Any:
        return self.loop.engine

    def _post(self, msg: AddRequest | AbortRequest) -> None:
        self.loop.submit(self, msg)

    def send(self, msg: OutputBatch | EngineStatus) -> None:
        """The loop's ``Connection`` to this client."""
        self._on_message(msg)

    def stats(self) -> dict[str, Any]:
        return self.loop.stats()

    def is_healthy(self) -> bool:
        return self._dead is None and self.loop.is_healthy()

    def shutdown(self) -> None:
        self.loop.stop()
        self._fail_all("the client was shut down")
