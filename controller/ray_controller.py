"""The controller actor: one engine replica (scheduler, KV manager, executor) served over ZeroMQ.

``Controller`` is a plain class (``ControllerActor`` is its Ray actor) that builds the executor
and the ``EngineCore`` and hands them to a ``ReplicaServer``, which needs no Ray and is what
the tests drive in-process too. The server runs two threads:

- the **engine thread** owns the ``EngineCore``: it applies queued commands between steps,
  steps while anything is unfinished, and after each step hands every client one
  ``OutputBatch`` with the deltas of that step (plus the ``AddResult`` of each add it applied);
- the **IO thread** owns the sockets: one ROUTER bound on the node's IP at port 0, to which
  every client connects a DEALER. Commands come in on it and replies, output batches and the
  death notice go back addressed by the client's identity. An inproc PUSH/PULL pair wakes the
  IO thread when the engine thread has something to send.

Request ids are namespaced per client inside the engine, so two clients may use the same ids.
A client that vanished (a send to it is unroutable) has its requests aborted. Only the
endpoint, the model facts and shutdown travel through Ray calls; per-token traffic never does.

Killing the actor takes the workers with it: the executor's worker actors and placement group
are created by (so owned by) this actor, and Ray tears down what a dead owner owned.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
import zmq

from pagedserve.config import EngineConfig
from pagedserve.controller.client import failed_output
from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.errors import RequestError
from pagedserve.controller.executor import create_executor
from pagedserve.controller.output_deltas import OutputDeltas
from pagedserve.messages import (
    AbortRequest,
    AddRequest,
    AddResult,
    EngineStatus,
    MessageDecodeError,
    OutputBatch,
    RequestOutput,
    StatusRequest,
    decode,
    encode,
)

__all__ = ["Controller", "ControllerActor", "ReplicaServer"]

logger = logging.getLogger(__name__)

_SEND_TIMEOUT_MS = 1000
_IO_POLL_MS = 100
_wake_ids = itertools.count()


class ReplicaServer:
    """Serves one ``EngineCore`` to ZeroMQ clients (see the module docstring)."""

    def __init__(
        self,
        engine: EngineCore,
        model_name: str,
        host: str = "127.0.0.1",
        *,
        replica_index: int = 0,
        idle_wait_s: float = 0.05,
        stats_extra: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.engine = engine
        self._stats_extra = stats_extra
        self.model_name = model_name
        self.replica_index = replica_index
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[tuple[bytes | None, Any]] = queue.SimpleQueue()
        self._owners: dict[str, tuple[bytes, str, int]] = {}  # engine id -> (client, its id, n)
        self._client_tags: dict[bytes, int] = {}
        self._deltas = OutputDeltas()
        self._stats: dict[str, Any] = {}
        self._dead: str | None = None
        self._stopping = threading.Event()
        self._ctx = zmq.Context(io_threads=1)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        self._router.setsockopt(zmq.SNDHWM, 100_000)
        if ":" in host:
            self._router.setsockopt(zmq.IPV6, 1)
        self._router.bind(f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0")
        self.endpoint: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        wake_addr = f"inproc://pagedserve-replica-wake-{next(_wake_ids)}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PUSH)  # used by the engine thread only
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(wake_addr)
        self._io = threading.Thread(target=self._io_loop, name="pagedserve-ctl-io", daemon=True)
        self._loop_thread = threading.Thread(
            target=self._engine_loop, name="pagedserve-ctl-engine", daemon=True
        )
        self._publish_stats()
        self._io.start()
        self._loop_thread.start()

    # ------------------------------------------------------------------ queries
    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def is_healthy(self) -> bool:
        engine_ok = getattr(self.engine, "healthy", True)
        return self._dead is None and self._loop_thread.is_alive() and bool(engine_ok)

    @property
    def error(self) -> str | None:
        return self._dead

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop (in-flight requests fail with an error output), the executor, the IO."""
        if self._loop_thread.is_alive():
            self._commands.put(None)
            self._loop_thread.join(timeout=timeout_s)
        try:
            self.engine.shutdown()
        finally:
            self._stopping.set()
            self._io.join(timeout=5.0)
            self._ctx.destroy(linger=0)

    # ------------------------------------------------------------------ engine thread
    def _engine_loop(self) -> None:
        reason = "engine shut down"
        try:
            while self._drain(block=not self.engine.has_unfinished()):
                outs = self.engine.step()
                self._publish_stats()  # first: a client that saw an output sees its effects
                if outs:
                    self._route(outs)
        except Exception as exc:  # the engine is unusable: fail everything, loudly, once
            logger.exception("replica %d: engine loop died", self.replica_index)
            reason = f"engine failed: {exc!r}"
        self._fail_all(reason)

    def _drain(self, block: bool) -> bool:
        cmds: list[tuple[Any, ...] | None] = []
        try:
            if block:
                cmds.append(self._commands.get(timeout=self._idle_wait_s))
            while True:
                cmds.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        outputs: list[tuple[bytes, str, RequestOutput]] = []
        for cmd in cmds:
            if cmd is None:
                self._flush(outputs)
                return False
            kind, client = cmd[0], cmd[1]
            if kind == "add":
                self._add(client, cmd[2])
            elif kind == "abort":
                key = self._key(client, cmd[2])
                if key in self._owners:
                    out = self.engine.abort_request(key)
                    if out is not None:
                        outputs.append((client, key, out))
            elif kind == "drop":  # the client is gone: nobody will read its outputs
                for key in [k for k, o in self._owners.items() if o[0] == client]:
                    self.engine.abort_request(key)
                    del self._owners[key]
                    self._deltas.forget(key)
        if cmds:
            self._publish_stats()
        self._flush(outputs)
        return True

    def _publish_stats(self) -> None:
        stats: dict[str, Any] = dict(self.engine.stats())
        if self._stats_extra is not None:
            extra = self._stats_extra()
            stats.update(extra)
            if any(self._stats.get(k) != v for k, v in extra.items()) and self._stats:
                # e.g. a rebuilt worker group's placement group: tell clients at once
                self._send(None, EngineStatus(self.is_healthy(), stats, self._dead, 0))
        self._stats = stats

    def _key(self, client: bytes, request_id: str) -> str:
        tag = self._client_tags.setdefault(client, len(self._client_tags))
        return f"c{tag}:{request_id}"

    def _add(self, client: bytes, msg: AddRequest) -> None:
        key = self._key(client, msg.request_id)
        try:
            self.engine.add_request(
                key, msg.prompt_token_ids, msg.params, prompt=msg.prompt, cache_salt=msg.cache_salt
            )
        except (RequestError, ValueError) as exc:
            message = str(exc).replace(key, msg.request_id)
            self._send(client, AddResult(msg.request_id, type(exc).__name__, message))
            return
        self._owners[key] = (client, msg.request_id, msg.params.n)
        self._send(client, AddResult(msg.request_id))

    def _route(self, outs: list[RequestOutput]) -> None:
        self._flush([(self._owners[o.request_id][0], o.request_id, o) for o in outs
                     if o.request_id in self._owners])

    def _flush(self, outputs: list[tuple[bytes, str, RequestOutput]]) -> None:
        """One ``OutputBatch`` per client for everything of this step."""
        batches: dict[bytes, OutputBatch] = {}
        for client, key, out in outputs:
            owner = self._owners.get(key)
            if owner is None:
                continue
            delta, starts = self._deltas.delta(out, key)
            delta.request_id = owner[1]
            if out.finished:
                del self._owners[key]
            batch = batches.setdefault(client, OutputBatch([], []))
            batch.outputs.append(delta)
            batch.text_starts.append(starts)
        for client, batch in batches.items():
            self._send(client, batch)

    def _send(self, client: bytes | None, msg: Any) -> None:
        self._outbox.put((client, msg))
        try:
            self._wake_tx.send(b"", flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # wake-ups are queued already: the IO thread drains the whole outbox on each

    def _fail_all(self, reason: str) -> None:
        self._dead = reason
        outputs = []
        for key, (client, _, n) in list(self._owners.items()):
            outputs.append((client, key, failed_output(key, [], n, reason)))
        self._flush(outputs)
        # Unblock adds that will never be applied, then tell every client.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd is not None and cmd[0] == "add":
                self._send(cmd[1], AddResult(cmd[2].request_id, "EngineDeadError", reason))
        self._send(None, EngineStatus(False, self._stats, reason, -1))

    # ------------------------------------------------------------------ IO thread
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        clients: set[bytes] = set()
        try:
            while not self._stopping.is_set():
                events = dict(poller.poll(_IO_POLL_MS))
                if self._router in events:
                    for _ in range(1000):  # bounded, so outputs are not starved
                        try:
                            frames = self._router.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if len(frames) == 2:
                            clients.add(frames[0])
                            self._on_command(frames[0], frames[1])
                if self._wake_rx in events:
                    self._drain_outbox(clients)
            self._drain_outbox(clients)
        except Exception:
            logger.exception("replica %d: IO thread died", self.replica_index)
            self._dead = self._dead or "controller IO thread died"

    def _drain_outbox(self, clients: set[bytes]) -> None:
        while True:
            try:
                self._wake_rx.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
        while True:
            try:
                client, msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            frame = encode(msg)
            for target in ([client] if client is not None else list(clients)):
                self._send_frame(target, frame, clients)

    def _send_frame(self, client: bytes, frame: bytes, clients: set[bytes]) -> None:
        try:
            self._router.send_multipart([client, frame])
        except (zmq.Again, zmq.ZMQError) as exc:
            logger.info("replica %d: client %s unreachable (%s); dropping its requests",
                        self.replica_index, client.hex(), exc)
            clients.discard(client)
            self._commands.put(("drop", client))

    def _on_command(self, client: bytes, body: bytes) -> None:
        try:
            msg = decode(body)
        except MessageDecodeError as exc:
            logger.warning("replica %d: dropping a bad frame: %s", self.replica_index, exc)
            return
        if isinstance(msg, StatusRequest):
            status = EngineStatus(self.is_healthy(), dict(self._stats), self._dead, msg.seq)
            self._send_frame(client, encode(status), set())
        elif isinstance(msg, AddRequest):
            if self._dead is not None:
                frame = encode(AddResult(msg.request_id, "EngineDeadError", self._dead))
                self._send_frame(client, frame, set())
            else:
                self._commands.put(("add", client, msg))
        elif isinstance(msg, AbortRequest):
            self._commands.put(("abort", client, msg.request_id))
        else:
            logger.warning("replica %d: unexpected %s", self.replica_index, type(msg).__name__)


class Controller:
    """One engine replica: executor + ``EngineCore`` + ``ReplicaServer`` (``ControllerActor``
    is this class as a Ray actor). ``executor_backend``: ``ray`` (worker actors) or ``local``."""

    def __init__(
        self, config: EngineConfig, *, replica_index: int = 0, executor_backend: str = "ray"
    ) -> None:
        from pagedserve.controller.launch import model_name
        from pagedserve.controller.tokenizer import load_tokenizer

        self.config = config
        self._start_error: Exception | None = None
        t0 = time.monotonic()
        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        try:
            executor = create_executor(config, backend=executor_backend)
            tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
            engine = EngineCore(config, executor, tokenizer=tokenizer)
        except Exception as exc:
            # Raised from ``info()`` instead: an actor whose constructor fails reaches the driver
            # as a bare ActorDiedError, a failed method call as the original exception.
            self._start_error = exc
            return
        self.server = ReplicaServer(
            engine, model_name(config), host, replica_index=replica_index,
            stats_extra=self._placement,
        )
        self._node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        logger.info("replica %d ready at %s in %.1f s", replica_index, self.server.endpoint,
                    time.monotonic() - t0)

    def _placement(self) -> dict[str, Any]:
        """The worker group's placement group id, published with the stats: Ray does not
        remove a placement group when the actor that created it dies (only once its job ends
        too), so whoever owns this controller removes it after a kill."""
        executor = self.server.engine.executor if hasattr(self, "server") else None
        pg = getattr(executor, "placement_group", None)
        return {"placement_group": pg.id.hex() if pg is not None else None}

    def info(self) -> dict[str, Any]:
        """What a client needs: the ZMQ endpoint and the model's facts (or why it never started)."""
        if self._start_error is not None:
            raise self._start_error
        engine = self.server.engine
        return {
            **self._placement(),
            "endpoint": self.server.endpoint,
            "model_name": self.server.model_name,
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size,
            "block_size": engine.kv.block_size,
            "replica_index": self.server.replica_index,
            "node_id": self._node_id,
            "pid": os.getpid(),
        }

    def ping(self) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return self.server.stats()

    def is_healthy(self) -> bool:
        return self.server.is_healthy()

    def worker_actors(self) -> list[Any]:
        """The executor's worker actor handles (none for the local executor)."""
        return list(getattr(self.server.engine.executor, "actors", []))

    def shutdown(self) -> None:
        self.server.shutdown()


# Threaded (max_concurrency=2) so that ping/info answer while shutdown runs; no CPU reserved:
# the controller schedules, its workers compute. max_restarts=0: a restarted controller would
# hold no requests and no workers; the client reports the death instead.
ControllerActor = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=2)(Controller)
