"""The one engine loop: a typed command queue in front of an ``EngineCore``.

Clients submit ``AddRequest`` and ``AbortRequest`` messages through a ``Connection`` (how the
loop answers them). Only the loop's thread touches the engine core: between steps it drains the
queue, and while any request is unfinished it steps, handing each client one ``OutputBatch``
per iteration with the verdicts on its adds and the step's deltas of its requests. When the
engine fails (or the loop stops) every owned request ends with an error delta, pending adds
are refused with ``EngineDeadError`` and every client hears ``EngineStatus(healthy=False)``.

Bounded: the loop holds at most ``scheduler.max_pending_requests`` requests (owned plus adds
queued); an add beyond that is refused at once with ``EngineOverloadedError``, nothing queued.
Aborts always pass. Each client's outputs leave the loop at once (sinks never block), so what
waits downstream is bounded by the requests held.

The in-process client (``controller.client.LocalEngineClient``) and the Ray controller actor
(``cluster.ray_controller``) both run this loop; they differ only in their connections.
Request ids are namespaced per connection, so two clients may use the same ids.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.errors import (
    EngineDeadError,
    EngineOverloadedError,
    RequestError,
    error_code,
)
from pagedserve.controller.outputs import failed_delta
from pagedserve.messages import (
    AbortRequest,
    AddRequest,
    AddResult,
    EngineStatus,
    OutputBatch,
    RequestDelta,
)

__all__ = ["Connection", "EngineLoop"]

logger = logging.getLogger(__name__)


class Connection(Protocol):
    """One client as the loop sees it. ``send`` runs on the loop thread and must not block."""

    def send(self, msg: OutputBatch | EngineStatus) -> None: ...


_Command = tuple[Connection, AddRequest | AbortRequest] | tuple[Connection, None]
"""``(conn, message)``; ``(conn, None)`` drops everything of a vanished client."""


class EngineLoop:
    """Runs an ``EngineCore`` on its own thread (see the module docstring).

    Given a factory instead of a core, the loop's thread builds it, and the constructor
    returns once it is built (raising what the build raised). An in-process engine is built
    that way so that one thread does all of its torch work: on this project's CPU hosts, once
    two threads of a process have run OpenMP regions, an op costs 2-3x on either of them
    (``benchmarks/scripts/thread_cost.py``), and loading and warming the model on the caller's
    thread made every later step pay that."""

    def __init__(self, engine: EngineCore | Callable[[], EngineCore], *,
                 idle_wait_s: float = 0.05) -> None:
        build = (lambda: engine) if isinstance(engine, EngineCore) else engine
        built = threading.Event()
        failure: list[BaseException] = []

        def build_then_run() -> None:
            try:
                self._start(build(), idle_wait_s)
            except BaseException as exc:  # handed to the constructor, which raises it
                failure.append(exc)
                return
            finally:
                built.set()
            self._run()

        self._thread = threading.Thread(target=build_then_run, name="pagedserve-engine",
                                        daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            self._thread.join()
            raise failure[0]

    def _start(self, engine: EngineCore, idle_wait_s: float) -> None:
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._owners: dict[str, tuple[Connection, str, int]] = {}  # key -> (conn, its id, n)
        self._tags: dict[int, str] = {}
        self._conns: dict[int, Connection] = {}
        self._batches: dict[int, OutputBatch] = {}
        self._stats: dict[str, Any] = dict(engine.stats())
        self._dead: str | None = None
        self._max_pending = engine.config.scheduler.max_pending_requests
        self._queued_adds = 0  # adds submitted and not yet applied (any thread: under a lock)
        self._lock = threading.Lock()
        self._idle_checked = True  # the KV check of this idle spell has run

    # ------------------------------------------------------------------ any thread
    def submit(self, conn: Connection, msg: AddRequest | AbortRequest) -> None:
        if isinstance(msg, AddRequest):
            refusal: Exception | None = None
            with self._lock:
                if self._dead is not None:
                    refusal = EngineDeadError(self._dead)
                elif len(self._owners) + self._queued_adds >= self._max_pending:
                    refusal = EngineOverloadedError(
                        f"the engine holds {self._max_pending} requests "
                        "(max_pending_requests); retry later"
                    )
                else:
                    self._queued_adds += 1
            if refusal is not None:
                conn.send(OutputBatch([_refusal(msg, refusal)], []))
                return
        elif self._dead is not None:
            return
        self._commands.put((conn, msg))

    def disconnect(self, conn: Connection) -> None:
        """The client is gone: abort its requests, nobody will read their outputs."""
        self._commands.put((conn, None))

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive() and self.engine.healthy

    @property
    def error(self) -> str | None:
        return self._dead or self.engine.dead_reason

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the loop (in-flight requests fail) and the executor. Idempotent."""
        if self._thread.is_alive():
            self._commands.put(None)
            self._thread.join(timeout=timeout_s)
        self.engine.shutdown()

    # ------------------------------------------------------------------ loop thread
    def _run(self) -> None:
        reason = "engine shut down"
        try:
            while self._drain(block=not self.engine.has_unfinished()):
                deltas = self.engine.step()
                self._stats = dict(self.engine.stats())  # before the outputs that it explains
                self._route(deltas)
                if not self.engine.healthy:
                    # Restarts are exhausted and the step ended its requests: refuse new ones
                    # and tell every client now, not at the next add.
                    reason = f"engine failed: {self.engine.dead_reason}"
                    break
        except Exception as exc:  # the engine is unusable: fail everything, loudly, once
            logger.exception("engine loop died")
            reason = f"engine failed: {exc!r}"
        self._fail_all(reason)

    def _drain(self, block: bool) -> bool:
        """Apply queued commands (waiting briefly for one when idle); False on stop."""
        cmds: list[_Command | None] = []
        try:
            if block:
                cmds.append(self._commands.get(timeout=self._idle_wait_s))
            while True:
                cmds.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        if cmds or not block:
            # Work, or a command that may bring some: the idle spell is over. (A request that
            # finishes in the step it was added in never makes the loop non-blocking.)
            self._idle_checked = False
        elif not self._idle_checked:
            # Idle and nobody waiting: the moment for the O(blocks) check, off the step path.
            self.engine.check_idle_kv()
            self._stats = dict(self.engine.stats())
            self._idle_checked = True
        running = True
        for i, cmd in enumerate(cmds):
            if cmd is None:
                running = False
                for rest in cmds[i + 1 :]:  # queued behind the stop: refused by _fail_all
                    self._commands.put(rest)
                break
            conn, msg = cmd
            if isinstance(msg, AddRequest):
                with self._lock:
                    self._queued_adds -= 1
                self._add(conn, msg)
            elif isinstance(msg, AbortRequest):
                delta = self.engine.abort_request(self._key(conn, msg.request_id))
                if delta is not None:
                    self._route([delta])
                    continue
            else:
                self._drop(conn)
        if cmds:
            self._stats = dict(self.engine.stats())
        self._flush()
        return running

    def _key(self, conn: Connection, request_id: str) -> str:
        tag = self._tags.get(id(conn))
        if tag is None:
            tag = self._tags[id(conn)] = f"c{len(self._tags)}"
            self._conns[id(conn)] = conn
        return f"{tag}:{request_id}"

    def _add(self, conn: Connection, msg: AddRequest) -> None:
        key = self._key(conn, msg.request_id)
        try:
            self.engine.add_request(dataclasses.replace(msg, request_id=key))
        except (RequestError, ValueError) as exc:
            self._batch(conn).results.append(_refusal(msg, exc, key))
            return
        self._owners[key] = (conn, msg.request_id, msg.params.n)
        self._batch(conn).results.append(AddResult(msg.request_id))

    def _drop(self, conn: Connection) -> None:
        for key in [k for k, o in self._owners.items() if o[0] is conn]:
            self.engine.abort_request(key)
            del self._owners[key]
        self._batches.pop(id(conn), None)
        self._conns.pop(id(conn), None)

    def _batch(self, conn: Connection) -> OutputBatch:
        batch = self._batches.get(id(conn))
        if batch is None:
            batch = self._batches[id(conn)] = OutputBatch([], [])
        return batch

    def _route(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            owner = self._owners.get(delta.request_id)
            if owner is None:
                continue
            conn, request_id, _ = owner
            if delta.finished:
                del self._owners[delta.request_id]
            delta.request_id = request_id
            self._batch(conn).outputs.append(delta)
        self._flush()

    def _flush(self) -> None:
        batches, self._batches = self._batches, {}
        for conn_id, batch in batches.items():
            conn = self._conns.get(conn_id)
            if conn is not None:
                _send(conn, batch)

    def _fail_all(self, reason: str) -> None:
        self._dead = reason
        for conn, request_id, n in list(self._owners.values()):
            self._batch(conn).outputs.append(failed_delta(request_id, list(range(n)), reason))
        self._owners.clear()
        # Refuse the adds that will never be applied, then tell every client.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd is not None and isinstance(cmd[1], AddRequest):
                conn = cmd[0]
                self._key(conn, cmd[1].request_id)
                self._batch(conn).results.append(_refusal(cmd[1], EngineDeadError(reason)))
        self._flush()
        status = EngineStatus(False, dict(self._stats), reason, -1)
        for conn in list(self._conns.values()):
            _send(conn, status)


def _refusal(msg: AddRequest, exc: BaseException, key: str | None = None) -> AddResult:
    text = str(exc)
    if key is not None:
        text = text.replace(key, msg.request_id)  # the client knows its own id only
    return AddResult(msg.request_id, error_code(exc), text)


def _send(conn: Connection, msg: OutputBatch | EngineStatus) -> None:
    try:
        conn.send(msg)
    except Exception:  # a broken client must not take the engine down
        logger.exception("sending to a client failed")
