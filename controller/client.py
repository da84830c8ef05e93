"""``EngineClient``: a thread-safe handle on a running engine, and the in-process one.

Front ends (the HTTP server, the batch job, ``LLM``) talk to an engine through this protocol
only, so the same front end runs on an engine loop in this process or on the Ray controller
actor behind ZeroMQ. Outputs are pushed: each request has a *sink* called with the request's
cumulative ``RequestOutput`` whenever it progresses, the last call having ``finished=True``.
Sinks run on the engine's thread and must not block; an asyncio front end hands them to its
loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.errors import RequestError
from pagedserve.controller.tokenizer import Tokenizer
from pagedserve.messages import CompletionOutput, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]


class EngineDeadError(RuntimeError):
    """The engine stopped (a worker died, or it was shut down); in-flight requests failed."""


class EngineClient(Protocol):
    """What a front end may call. Every method is safe from any thread.

    ``add_request`` validates synchronously and raises a ``RequestError`` subclass for bad
    input (nothing is queued then) or ``EngineDeadError`` when the engine is down.
    """

    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Tokenizer | None

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        *,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def is_healthy(self) -> bool: ...

    def shutdown(self) -> None: ...


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: Sink
    prompt: str | None
    cache_salt: str | None
    done: threading.Event
    error: BaseException | None = None


def failed_output(
    request_id: str, prompt_token_ids: list[int], n: int, error: str
) -> RequestOutput:
    """The final output of a request that the engine could not finish."""
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=prompt_token_ids,
        outputs=[CompletionOutput(i, "", [], finish_reason="error") for i in range(n)],
        finished=True,
        error=error,
    )


class EngineThread:
    """Runs an ``EngineCore`` step loop on a background thread (an ``EngineClient``).

    Commands (add, abort) go through a queue drained between steps, so only the loop thread
    ever touches the engine core; ``stats()`` reads a snapshot the loop publishes each step.
    """

    def __init__(self, engine: EngineCore, model_name: str, *, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.tokenizer = engine.tokenizer
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[_Add | str | None] = queue.SimpleQueue()
        self._sinks: dict[str, tuple[Sink, list[int], int]] = {}
        self._stats: dict[str, Any] = engine.stats()
        self._dead: str | None = None
        self._thread = threading.Thread(target=self._loop, name="pagedserve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ client side
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        *,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        done = threading.Event()
        cmd = _Add(request_id, prompt_token_ids, params, sink, prompt, cache_salt, done)
        self._commands.put(cmd)
        # Validation runs on the loop thread; its answer comes back within one step.
        while not cmd.done.wait(1.0):
            if self._dead is not None:
                raise EngineDeadError(self._dead)
        if cmd.error is not None:
            raise cmd.error

    def abort_request(self, request_id: str) -> None:
        self._commands.put(request_id)

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._commands.put(None)
            self._thread.join(timeout=30)
        self.engine.shutdown()

    # ------------------------------------------------------------------ loop side
    def _loop(self) -> None:
        try:
            while True:
                if not self._drain(block=not self.engine.has_unfinished()):
                    break
                for out in self.engine.step():
                    self._deliver(out)
                self._stats = self.engine.stats()
        except Exception as exc:  # the engine is unusable: fail everything, loudly, once
            logger.exception("engine loop died")
            self._fail_all(f"engine failed: {exc!r}")
        else:
            self._fail_all("engine shut down")

    def _drain(self, block: bool) -> bool:
        """Apply queued commands (waiting briefly for one when idle); False on shutdown."""
        cmds: list[_Add | str | None] = []
        try:
            if block:
                cmds.append(self._commands.get(timeout=self._idle_wait_s))
            while True:
                cmds.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        for cmd in cmds:
            if cmd is None:
                return False
            if isinstance(cmd, _Add):
                self._add(cmd)
            else:
                out = self.engine.abort_request(cmd)
                if out is not None:
                    self._deliver(out)
        return True

    def _add(self, cmd: _Add) -> None:
        try:
            self.engine.add_request(
                cmd.request_id, cmd.prompt_token_ids, cmd.params,
                prompt=cmd.prompt, cache_salt=cmd.cache_salt,
            )
            self._sinks[cmd.request_id] = (cmd.sink, cmd.prompt_token_ids, cmd.params.n)
        except (RequestError, ValueError) as exc:
            cmd.error = exc
        finally:
            cmd.done.set()

    def _deliver(self, out: RequestOutput) -> None:
        entry = self._sinks.get(out.request_id)
        if entry is None:
            return
        if out.finished:
            del self._sinks[out.request_id]
        try:
            entry[0](out)
        except Exception:  # a broken front end must not take the engine down
            logger.exception("output sink of request %s failed", out.request_id)

    def _fail_all(self, reason: str) -> None:
        self._dead = reason
        sinks, self._sinks = self._sinks, {}
        for request_id, (sink, prompt_ids, n) in sinks.items():
            try:
                sink(failed_output(request_id, prompt_ids, n, reason))
            except Exception:
                logger.exception("output sink of request %s failed", request_id)
        # Unblock anyone waiting on an add that will never be applied.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                cmd.error = EngineDeadError(reason)
                cmd.done.set()
