"""``RemoteEngineClient``: the ``EngineClient`` API over ZeroMQ to a controller actor.

One DEALER socket, connected to the controller's ROUTER and owned by a background IO thread.
Callers hand their frames to that thread (a queue plus an inproc wake-up), so every method is
safe from any thread. The IO thread receives ``OutputBatch``es (add verdicts, resolving the
callers' futures, and each request's deltas, handed to its sink) and ``EngineStatus`` answers.
It also sends a ``StatusRequest`` heartbeat every ``heartbeat_s``; when nothing has been heard
for ``dead_after_s`` (or the connection drops), it asks Ray whether the actor is alive. A dead
actor (or one silent past ``dead_after_s`` whose ping does not answer either, then killed) is
lost: every request ends with an error delta coded ``ControllerLostError``, later calls raise
it, and ``on_lost`` hears of it (``cluster.replica`` starts another controller and the router
moves the requests there). Every wait is bounded.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from pagedserve.cluster.mailbox import Mailbox
from pagedserve.controller.client import ClientBase
from pagedserve.controller.errors import ControllerLostError, EngineDeadError
from pagedserve.controller.tokenizer import Tokenizer
from pagedserve.frame_auth import FrameAuth
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
from pagedserve.net import is_ipv6, parse_tcp_endpoint

__all__ = ["RemoteEngineClient"]

logger = logging.getLogger(__name__)



class RemoteEngineClient(ClientBase):
    """An ``EngineClient`` talking to one ``ReplicaServer`` at ``endpoint``.

    ``info`` is the controller's ``info()`` (model name, limits). ``actor``, when given, is the
    controller's Ray handle: it confirms a suspected death. ``on_close`` runs once, at the end
    of ``shutdown`` or when the controller is lost (the launcher's: it stops the actor).
    ``on_lost(reason)`` runs once, on the IO thread, after a lost controller's requests failed.
    """

    def __init__(
        self,
        endpoint: str,
        info: dict[str, Any],
        *,
        tokenizer: Tokenizer | None = None,
        actor: Any = None,
        on_close: Callable[[], None] | None = None,
        on_lost: Callable[[str], None] | None = None,
        heartbeat_s: float = 1.0,
        dead_after_s: float = 10.0,
        add_timeout_s: float = 120.0,
    ) -> None:
        super().__init__(add_timeout_s=add_timeout_s)
        self.endpoint = endpoint
        self.info = dict(info)
        self.model_name: str = info["model_name"]
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self.block_size: int = info["block_size"]
        self.tokenizer = tokenizer
        self._auth = FrameAuth(info["auth_key"])
        self.actor = actor
        self._on_close = on_close
        self._on_lost = on_lost
        self._heartbeat_s = heartbeat_s
        self._dead_after_s = dead_after_s
        self._status_seq = itertools.count(1)
        self._status: EngineStatus | None = None
        self._status_cv = threading.Condition()
        self._stopping = threading.Event()
        self._last_rx = time.monotonic()
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        if is_ipv6(parse_tcp_endpoint(endpoint)[0]):
            self._sock.setsockopt(zmq.IPV6, 1)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(endpoint)
        self._outgoing: Mailbox[bytes] = Mailbox(self._ctx, "client-outbox")
        self._io = threading.Thread(target=self._io_loop, name="pagedserve-client", daemon=True)
        self._io.start()

    # ------------------------------------------------------------------ EngineClient
    def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The engine's latest stats (asks for fresh ones; the last known after ``timeout_s``)."""
        if self._dead is None:
            seq = next(self._status_seq)
            self._send(StatusRequest(seq))
            with self._status_cv:
                self._status_cv.wait_for(
                    lambda: self._dead is not None
                    or (self._status is not None and self._status.seq >= seq),
                    timeout=timeout_s,
                )
        status = self._status
        return dict(status.stats) if status is not None else {}

    def is_healthy(self) -> bool:
        return self._dead is None and (self._status is None or self._status.healthy)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort what is in flight, stop the IO thread, then ``on_close``."""
        for request_id in list(self._requests):
            self.abort_request(request_id)
        self._stopping.set()
        self._io.join(timeout=5.0)
        self._fail_all("the client was shut down")
        self._outgoing.close()
        self._ctx.destroy(linger=0)
        self._close()

    def _close(self) -> None:
        with self._lock:
            on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    # ------------------------------------------------------------------ IO thread
    def _post(self, msg: AddRequest | AbortRequest) -> None:
        self._send(msg)

    def _send(self, msg: Any) -> None:
        self._outgoing.put(encode(msg))

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._outgoing.waker, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while not self._stopping.is_set() and self._dead is None:
                events = dict(poller.poll(100))
                if self._outgoing.waker in events:
                    self._send_outgoing()
                if self._sock in events:
                    for _ in range(1000):
                        try:
                            frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._last_rx = time.monotonic()
                        self._on_frames(frames)
                if self._monitor in events:
                    recv_monitor_message(self._monitor)
                    self._check_alive("the connection to the controller dropped", at_once=True)
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self._heartbeat_s
                    self._send(StatusRequest(0))
                    if now - self._last_rx > self._dead_after_s:
                        self._check_alive(f"no word from the controller for {self._dead_after_s} s")
            self._send_outgoing()  # the aborts of a shutdown
        except Exception as exc:
            logger.exception("client IO thread died")
            self._fail_all(f"client IO failed: {exc!r}")

    def _send_outgoing(self) -> None:
        frames = self._outgoing.drain()
        for i, frame in enumerate(frames):
            try:
                self._sock.send_multipart(self._auth.seal([frame]), flags=zmq.NOBLOCK)
            except zmq.Again:
                self._outgoing.put_back(frames[i:])
                self._check_alive("the controller does not take commands", at_once=True)
                return

    def _check_alive(self, reason: str, at_once: bool = False) -> None:
        """Ask Ray about the actor; fail everything if it is dead (or, without a handle or an
        answer, once silence has lasted ``dead_after_s``)."""
        if self.actor is not None:
            import ray

            try:
                ray.get(self.actor.ping.remote(), timeout=2.0)
                self._last_rx = time.monotonic()
                return
            except ray.exceptions.GetTimeoutError:
                pass
            except Exception as exc:
                self._lose(f"{reason}: the controller actor is gone ({type(exc).__name__})")
                return
        if not at_once and time.monotonic() - self._last_rx > self._dead_after_s:
            if self.actor is None:
                self._fail_all(reason)
            else:  # alive to Ray but deaf: it is replaced all the same
                self._lose(f"{reason}, nor to a ping")

    def _lose(self, reason: str) -> None:
        import ray

        try:  # already dead, or hung: nothing of it may outlive this decision
            ray.kill(self.actor, no_restart=True)
        except Exception as exc:
            logger.debug("killing a lost controller: %r", exc)
        logger.warning("controller lost: %s", reason)
        self._fail_all(reason, ControllerLostError)
        self._close()
        if self._on_lost is not None:
            self._on_lost(reason)

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            msg = decode_message(self._auth.open(frames)[0], (OutputBatch, EngineStatus))
        except MessageDecodeError as exc:  # FrameAuthError included
            logger.warning("dropping a bad frame from the controller: %s", exc)
            return
        if isinstance(msg, EngineStatus):
            with self._status_cv:
                if msg.seq != 0 or self._status is None:
                    self._status = msg
                else:  # a heartbeat answer must not hide a newer numbered one
                    self._status = EngineStatus(msg.healthy, msg.stats, msg.error,
                                                self._status.seq)
                self._status_cv.notify_all()
        self._on_message(msg)

    def _fail_all(self, reason: str, error: type[EngineDeadError] = EngineDeadError) -> None:
        super()._fail_all(reason, error)
        with self._status_cv:
            self._status_cv.notify_all()
