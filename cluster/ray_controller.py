"""The controller actor: one engine replica's ``EngineLoop`` served over ZeroMQ.

``ReplicaServer`` needs no Ray (the tests drive it in-process too): it owns an ``EngineLoop``
and an IO thread that owns the sockets: one ROUTER bound on the node's IP at port 0, to which
every client connects a DEALER. Commands come in on it and go to the loop through one
``Connection`` per client identity; what the loop sends a connection (an ``OutputBatch`` per
loop iteration, the death notice) goes back addressed by that identity. An inproc PUSH/PULL
pair wakes the IO thread when the loop has something to send. A client that vanished (a send
to it is unroutable) is disconnected from the loop, which aborts its requests. Only the
endpoint, the model facts and shutdown travel through Ray calls; per-token traffic never does.

``Controller`` (``ControllerActor`` as a Ray actor) builds its engine with the factory the
composition root passes in, so this package never names the workers. Killing the actor takes
the workers with it: Ray tears down the actors a dead owner created.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
import zmq

from pagedserve.cluster.mailbox import Mailbox
from pagedserve.config import EngineConfig
from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.loop import EngineLoop
from pagedserve.frame_auth import FrameAuth, FrameAuthError
from pagedserve.messages import (
    AbortRequest,
    AddRequest,
    EngineStatus,
    MessageDecodeError,
    OutputBatch,
    StatusRequest,
    decode_message,
    encode,
)
from pagedserve.net import is_ipv6, tcp_endpoint

__all__ = ["Controller", "ControllerActor", "EngineFactory", "ReplicaServer"]

logger = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig, Any], EngineCore]
"""``(config, placement_group or None) -> EngineCore``: the composition root's builder."""

_SEND_TIMEOUT_MS = 1000
_IO_POLL_MS = 100


class _ClientConn:
    """The loop's ``Connection`` to one ZeroMQ client: queue for the IO thread and wake it."""

    __slots__ = ("identity", "server")

    def __init__(self, server: ReplicaServer, identity: bytes) -> None:
        self.server = server
        self.identity = identity

    def send(self, msg: OutputBatch | EngineStatus) -> None:
        self.server._queue_send(self.identity, msg)


class ReplicaServer:
    """Serves one ``EngineLoop`` to ZeroMQ clients (see the module docstring)."""

    def __init__(
        self,
        loop: EngineLoop,
        model_name: str,
        host: str = "127.0.0.1",
        *,
        replica_index: int = 0,
    ) -> None:
        self.loop = loop
        self.model_name = model_name
        self.replica_index = replica_index
        self.auth = FrameAuth.new()  # its key reaches clients through Ray, in ``info()``
        self._conns: dict[bytes, _ClientConn] = {}
        self._stopping = threading.Event()
        self._ctx = zmq.Context(io_threads=1)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        self._router.setsockopt(zmq.SNDHWM, 100_000)
        if is_ipv6(host):
            self._router.setsockopt(zmq.IPV6, 1)
        self._router.bind(tcp_endpoint(host))
        self.endpoint: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._outbox: Mailbox[tuple[bytes, Any]] = Mailbox(self._ctx, "replica-outbox")
        self._io = threading.Thread(target=self._io_loop, name="pagedserve-ctl-io", daemon=True)
        self._io.start()

    @property
    def engine(self) -> EngineCore:
        return self.loop.engine

    def stats(self) -> dict[str, Any]:
        return self.loop.stats()

    def is_healthy(self) -> bool:
        return self.loop.is_healthy()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop (in-flight requests fail with an error delta), the executor, the IO."""
        try:
            self.loop.stop(timeout_s)
        finally:
            self._stopping.set()
            self._io.join(timeout=5.0)
            self._outbox.close()
            self._ctx.destroy(linger=0)

    def _queue_send(self, identity: bytes, msg: Any) -> None:
        self._outbox.put((identity, msg))

    # ------------------------------------------------------------------ IO thread
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._outbox.waker, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                events = dict(poller.poll(_IO_POLL_MS))
                if self._router in events:
                    for _ in range(1000):  # bounded, so outputs are not starved
                        try:
                            frames = self._router.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_frames(frames)
                if self._outbox.waker in events:
                    self._drain_outbox()
            self._drain_outbox()
        except Exception:
            logger.exception("replica %d: IO thread died", self.replica_index)

    def _drain_outbox(self) -> None:
        for identity, msg in self._outbox.drain():
            self._send_frame(identity, encode(msg))

    def _send_frame(self, identity: bytes, frame: bytes) -> None:
        try:
            self._router.send_multipart([identity, *self.auth.seal([frame])])
        except (zmq.Again, zmq.ZMQError) as exc:
            conn = self._conns.pop(identity, None)
            if conn is not None:
                logger.info("replica %d: client %s unreachable (%s); dropping its requests",
                            self.replica_index, identity.hex(), exc)
                self.loop.disconnect(conn)

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            identity, body = frames[0], self.auth.open(frames[1:])[0]
            msg = decode_message(body, (AddRequest, AbortRequest, StatusRequest))
        except FrameAuthError:
            # A stranger (or a stale client of another engine): never a command.
            logger.warning("replica %d: dropped a frame that failed authentication",
                           self.replica_index)
            return
        except MessageDecodeError as exc:
            logger.warning("replica %d: dropping a bad frame: %s", self.replica_index, exc)
            return
        conn = self._conns.get(identity)
        if conn is None:
            conn = self._conns[identity] = _ClientConn(self, identity)
        if isinstance(msg, StatusRequest):
            loop = self.loop
            status = EngineStatus(loop.is_healthy(), loop.stats(), loop.error, msg.seq)
            self._send_frame(identity, encode(status))
        else:
            self.loop.submit(conn, msg)


class Controller:
    """One engine replica: ``build(config, placement_group)`` -> ``EngineCore``, its
    ``EngineLoop`` and a ``ReplicaServer`` (``ControllerActor`` is this class as a Ray actor).
    ``placement_group`` is the worker group's, created and removed by the launcher."""

    def __init__(
        self,
        config: EngineConfig,
        build: EngineFactory,
        *,
        model_name: str,
        placement_group: Any = None,
        replica_index: int = 0,
    ) -> None:
        self.config = config
        self._start_error: Exception | None = None
        t0 = time.monotonic()
        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        try:
            engine = build(config, placement_group)
        except Exception as exc:
            # Raised from ``info()`` instead: an actor whose constructor fails reaches the driver
            # as a bare ActorDiedError, a failed method call as the original exception.
            self._start_error = exc
            return
        self.server = ReplicaServer(
            EngineLoop(engine), model_name, host, replica_index=replica_index
        )
        self._node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        logger.info("replica %d ready at %s in %.1f s", replica_index, self.server.endpoint,
                    time.monotonic() - t0)

    def info(self) -> dict[str, Any]:
        """What a client needs: the ZMQ endpoint and the model's facts (or why it never started)."""
        if self._start_error is not None:
            raise self._start_error
        engine = self.server.engine
        return {
            "endpoint": self.server.endpoint,
            "auth_key": self.server.auth.key,
            "model_name": self.server.model_name,
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size,
            "block_size": engine.kv.block_size,
            "replica_index": self.server.replica_index,
            "node_id": self._node_id,
            "pid": os.getpid(),
            # Where each rank runs (Ray executors only): rank, node id, node IP.
            "ranks": getattr(engine.executor, "rank_nodes", list)(),
        }

    def ping(self) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return self.server.stats()

    def is_healthy(self) -> bool:
        return self.server.is_healthy()

    def worker_actors(self) -> list[Any]:
        """The executor's worker actor handles, by rank (for tests and diagnostics)."""
        return self.server.engine.executor.worker_actors()

    def shutdown(self) -> None:
        self.server.shutdown()


# Threaded (max_concurrency=2) so that ping/info answer while shutdown runs; no CPU reserved:
# the controller schedules, its workers compute. max_restarts=0: a restarted actor would hold
# no requests and no workers and listen on a new endpoint; the front end starts a new one
# itself (``cluster.replica``) and moves the requests to it.
ControllerActor = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=2)(Controller)
