"""The engine side of one HTTP request: submit, gather outputs on the event loop, abort.

``EngineRun`` owns the engine requests of one API call (one per prompt of a batch). Each
request's sink runs on a client thread and only hands the ``RequestDelta`` to the event loop;
there the run folds it into the request's cumulative output (``latest``, for a whole answer),
keeps it for streaming (``take_pending``: the deltas not yet sent, which a slow reader gets
coalesced into one event), feeds the metrics, and wakes whoever is waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

from pagedserve.controller.client import EngineClient
from pagedserve.controller.errors import RequestFailedError
from pagedserve.controller.outputs import OutputAccumulator
from pagedserve.messages import AddRequest, RequestDelta, RequestOutput, SamplingParams
from pagedserve.serving.openai.api_errors import InternalError, engine_unavailable
from pagedserve.serving.openai.cpu_pool import CpuPool
from pagedserve.serving.openai.limits import ServerLimits
from pagedserve.serving.openai.metrics import ServerMetrics

__all__ = ["ClientGone", "EngineRun", "InFlight", "Prompt", "ServerContext"]


# How long an add may wait for the engine's verdict (it comes within one engine step).
ADD_TIMEOUT_S = 120.0

# How often a waiting answer asks whether its client is still there, output arriving or not: a
# gone client's requests are aborted within this (plus one engine step).
DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class InFlight:
    """A thread-safe count of calls in progress; ``on_idle`` callbacks run when it drops to 0.

    The server counts its interactive calls (``/v1/completions``, ``/v1/chat/completions``)
    here, from arrival until the answer or stream is over; the batch runner reads it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._on_idle: list[Callable[[], None]] = []

    @property
    def count(self) -> int:
        return self._count

    def enter(self) -> None:
        with self._lock:
            self._count += 1

    def exit(self) -> None:
        with self._lock:
            self._count -= 1
            idle = self._count == 0
        if idle:
            for callback in list(self._on_idle):
                callback()

    def on_idle(self, callback: Callable[[], None]) -> None:
        self._on_idle.append(callback)


@dataclass
class ServerContext:
    """What the handlers of one app share."""

    client: EngineClient
    metrics: ServerMetrics
    interactive: InFlight = field(default_factory=InFlight)
    """Interactive API calls in progress (the Batch API's lines are not counted)."""
    limits: ServerLimits = field(default_factory=ServerLimits)
    pool: CpuPool = field(default_factory=CpuPool)
    """Where tokenizing and response building run, off the event loop."""
    allow_special_tokens_in_content: bool = False
    """Chat messages' control-token text (``</s>``) becomes real tokens instead of text."""
    tool_call_parser: str | None = None
    """How ``tool_choice`` auto reads calls (None: as the chat template's syntax shows)."""
    reasoning_parser: str | None = None
    """How a thinking model's reasoning is split off its answers (None: it is not)."""


@dataclass(slots=True)
class Prompt:
    text: str | None
    token_ids: list[int]


@dataclass(slots=True)
class _Sub:
    request_id: str
    prompt: Prompt
    acc: OutputAccumulator
    latest: RequestOutput | None = None
    pending: list[RequestDelta] = field(default_factory=list)
    submitted: bool = False
    done: bool = False
    first_token_time: float | None = None
    last_token_time: float = 0.0
    counted_tokens: int = 0


class EngineRun:
    """The engine requests behind one API call, sharing one set of sampling parameters."""

    def __init__(
        self,
        ctx: ServerContext,
        base_id: str,
        prompts: list[Prompt],
        params: SamplingParams,
        cache_salt: str | None,
        priority: int = 0,
    ) -> None:
        self.client = ctx.client
        self.priority = priority
        self.metrics = ctx.metrics
        self.params = params
        self.cache_salt = cache_salt
        self.arrival = time.monotonic()
        ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
        self.subs = [
            _Sub(rid, p, OutputAccumulator(rid, p.text, p.token_ids, params.n))
            for rid, p in zip(ids, prompts, strict=True)
        ]
        self._wake = asyncio.Event()
        self._closed = False

    # ----------------------------------------------------------------------- submission
    async def start(self) -> None:
        """Add every request; on any refusal abort those already added and raise."""
        loop = asyncio.get_running_loop()
        try:
            for i, sub in enumerate(self.subs):
                sub.submitted = True  # before the call: aborting an unknown id is harmless
                req = AddRequest(sub.request_id, sub.prompt.token_ids, self.params,
                                 sub.prompt.text, self.cache_salt, self.priority)
                # The verdict comes as a future: awaited here, no thread waits for it.
                fut = self.client.submit(req, partial(self._from_engine, loop, i))
                try:
                    await asyncio.wait_for(asyncio.wrap_future(fut), ADD_TIMEOUT_S)
                except asyncio.TimeoutError:
                    raise engine_unavailable(
                        f"the engine did not answer within {ADD_TIMEOUT_S:.0f} s") from None
                self.metrics.prompt_tokens.inc(len(sub.prompt.token_ids))
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Abort every request not yet finished (the client went away, or a sibling failed)."""
        for sub in self.subs:
            if sub.submitted and not sub.done:
                sub.done = True
                try:
                    self.client.abort_request(sub.request_id)
                except Exception:  # the engine may be gone already; nothing left to free
                    pass

    def close(self) -> None:
        """Abort what still runs and drop every output not yet sent (a stream whose client
        stopped reading): nothing of the run is kept any more."""
        self.abort()
        self._closed = True
        for sub in self.subs:
            sub.pending.clear()

    # --------------------------------------------------------------------------- outputs
    def _from_engine(
        self, loop: asyncio.AbstractEventLoop, index: int, delta: RequestDelta
    ) -> None:
        """The sink: runs on a client thread, so only hop onto the loop."""
        try:
            loop.call_soon_threadsafe(self._on_output, index, delta)
        except RuntimeError:  # the loop is closed: nobody is waiting for this any more
            pass

    def _on_output(self, index: int, delta: RequestDelta) -> None:
        sub = self.subs[index]
        if sub.latest is not None and sub.latest.finished:
            return
        out = sub.acc.add(delta)
        if not self._closed:  # closed: nobody will send it (the final delta still counts)
            sub.pending.append(delta)
        now = time.monotonic()
        ntok = sum(len(c.token_ids) for c in out.outputs)
        if ntok > sub.counted_tokens:
            self.metrics.generation_tokens.inc(ntok - sub.counted_tokens)
            sub.counted_tokens = ntok
        steps = max((len(d.token_ids) for d in delta.completions), default=0)
        if steps and sub.first_token_time is not None:  # inter-token latency, per token
            for _ in range(steps):
                self.metrics.itl.observe((now - sub.last_token_time) / steps)
        if steps:
            sub.last_token_time = now
        if sub.first_token_time is None and ntok > 0:
            sub.first_token_time = now
            self.metrics.ttft.observe(now - self.arrival)
        if out.finished:
            self.metrics.record_finished(
                [c.finish_reason for c in out.outputs],
                self.arrival,
                sub.first_token_time,
                now,
                max((len(c.token_ids) for c in out.outputs), default=0),
            )
        sub.latest = out
        if out.finished:
            sub.done = True
        self._wake.set()

    def take_pending(self, index: int) -> list[RequestDelta]:
        """The deltas of request ``index`` that arrived since the last call."""
        sub = self.subs[index]
        pending, sub.pending = sub.pending, []
        return pending

    @property
    def finished(self) -> bool:
        return all(s.latest is not None and s.latest.finished for s in self.subs)

    async def updates(
        self, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[None]:
        """Yield once after each batch of progress, until every request has finished and every
        delta has been yielded for.

        The wake flag, not ``finished``, drives the loop: a delta sets it on the event loop's
        thread, so one that lands before the first read, or while the caller handles the
        previous update (the final one included), is always followed by one more yield.
        With ``is_disconnected``, ask it every ``DISCONNECT_POLL_S``, output arriving or not,
        and raise ``ClientGone`` (after aborting) when the client left; streaming responses
        detect that on their own.
        """
        asked = time.monotonic()
        while True:
            if is_disconnected is not None and time.monotonic() - asked >= DISCONNECT_POLL_S:
                if await is_disconnected():
                    self.abort()
                    raise ClientGone()
                asked = time.monotonic()
            if self._wake.is_set():
                self._wake.clear()
                self.check_errors()
                yield
                continue
            if self.finished:
                return
            if is_disconnected is None:
                await self._wake.wait()
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=DISCONNECT_POLL_S)

    def check_errors(self) -> None:
        for sub in self.subs:
            out = sub.latest
            if out is not None and out.error is not None:
                self.abort()
                if out.error_code != RequestFailedError.__name__:  # the engine's failure
                    healthy = False
                    try:
                        healthy = self.client.is_healthy()
                    except Exception:
                        pass
                    if not healthy:
                        raise engine_unavailable(f"the engine failed: {out.error}")
                raise InternalError(f"engine request {sub.request_id} failed: {out.error}")

    async def wait(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> None:
        async for _ in self.updates(is_disconnected):
            pass
