"""``RemoteEngineClient``: the ``EngineClient`` API over ZeroMQ to a controller actor.

One DEALER socket, connected to the controller's ROUTER and owned by a background IO thread.
Callers hand their frames to that thread (a queue plus an inproc wake-up), so every method is
safe from any thread. The IO thread receives ``AddResult``s (resolving the caller's future),
``OutputBatch``es (merged back into cumulative ``RequestOutput``s and given to the request's
sink) and ``EngineStatus`` answers. It also sends a ``StatusRequest`` heartbeat every
``heartbeat_s``; when nothing has been heard for ``dead_after_s`` (or the connection drops), it
asks Ray whether the actor is alive and, if not, fails every request with an error output and
makes later calls raise ``EngineDeadError``. Every wait is bounded.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from pagedserve.controller import errors as request_errors
from pagedserve.controller.client import EngineDeadError, Sink, failed_output
from pagedserve.controller.errors import DuplicateRequestError, RequestError
from pagedserve.controller.output_deltas import OutputMerger
from pagedserve.controller.tokenizer import Tokenizer
from pagedserve.messages import (
    AbortRequest,
    AddRequest,
    AddResult,
    EngineStatus,
    MessageDecodeError,
    OutputBatch,
    RequestOutput,
    SamplingParams,
    StatusRequest,
    decode,
    encode,
)

__all__ = ["RemoteEngineClient", "error_from_result"]

logger = logging.getLogger(__name__)

_wake_ids = itertools.count()


def error_from_result(result: AddResult) -> Exception:
    """The typed exception a refused ``AddResult`` stands for."""
    name, message = result.error_type or "RequestError", result.error_message or ""
    if name == "EngineDeadError":
        return EngineDeadError(message)
    cls = getattr(request_errors, name, None)
    if isinstance(cls, type) and issubclass(cls, RequestError):
        return cls(message)
    if name == "ValueError" or name.endswith("Error"):
        return RequestError(f"{name}: {message}")
    return RequestError(message)


class RemoteEngineClient:
    """An ``EngineClient`` talking to one ``ReplicaServer`` at ``endpoint``.

    ``info`` is the controller's ``info()`` (model name, limits). ``actor``, when given, is the
    controller's Ray handle: it confirms a suspected death, and with ``owns_actor`` the client
    shuts the actor down (and kills it) in ``shutdown``.
    """

    def __init__(
        self,
        endpoint: str,
        info: dict[str, Any],
        *,
        tokenizer: Tokenizer | None = None,
        actor: Any = None,
        owns_actor: bool = False,
        heartbeat_s: float = 1.0,
        dead_after_s: float = 10.0,
        add_timeout_s: float = 120.0,
    ) -> None:
        self.endpoint = endpoint
        self.info = dict(info)
        self.model_name: str = info["model_name"]
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self.tokenizer = tokenizer
        self.actor = actor
        self._owns_actor = owns_actor
        self._heartbeat_s = heartbeat_s
        self._dead_after_s = dead_after_s
        self._add_timeout_s = add_timeout_s
        self._lock = threading.Lock()
        self._requests: dict[str, OutputMerger] = {}
        self._adds: dict[str, deque[Future[None]]] = {}
        self._outgoing: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._status_seq = itertools.count(1)
        self._status: EngineStatus | None = None
        # Every worker placement group the controller reported (see _remove_placement_group).
        self._placement_groups: set[str] = {info["placement_group"]} if info.get(
            "placement_group") else set()
        self._status_cv = threading.Condition()
        self._dead: str | None = None
        self._stopping = threading.Event()
        self._last_rx = time.monotonic()
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        if endpoint.startswith("tcp://["):
            self._sock.setsockopt(zmq.IPV6, 1)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(endpoint)
        wake_addr = f"inproc://pagedserve-client-wake-{next(_wake_ids)}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PUSH)  # shared by callers: used under _lock
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(wake_addr)
        self._io = threading.Thread(target=self._io_loop, name="pagedserve-client", daemon=True)
        self._io.start()

    # ------------------------------------------------------------------ EngineClient
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
        fut = self.add_request_async(
            request_id, prompt_token_ids, params, sink, prompt=prompt, cache_salt=cache_salt
        )
        self.wait_added(fut)

    def add_request_async(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        *,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> Future[None]:
        """Send the request without waiting for the verdict: many adds then pipeline over one
        round trip. ``wait_added(future)`` raises what ``add_request`` would have."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        ids = [int(t) for t in prompt_token_ids]
        fut: Future[None] = Future()
        with self._lock:
            if request_id in self._requests:
                raise DuplicateRequestError(f"request id {request_id!r} is already in use")
            self._requests[request_id] = OutputMerger(sink, prompt, ids, params.n)
            self._adds.setdefault(request_id, deque()).append(fut)
        self._post(AddRequest(request_id, ids, params, prompt, cache_salt))
        return fut

    def wait_added(self, fut: Future[None]) -> None:
        deadline = time.monotonic() + self._add_timeout_s
        while True:
            try:
                fut.result(timeout=0.5)
                return
            except TimeoutError:
                if self._dead is not None:
                    raise EngineDeadError(self._dead) from None
                if time.monotonic() > deadline:
                    raise EngineDeadError(
                        f"the controller did not answer an add within {self._add_timeout_s} s"
                    ) from None

    def abort_request(self, request_id: str) -> None:
        if self._dead is None:
            self._post(AbortRequest(request_id))

    def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The engine's latest stats (asks for fresh ones; the last known after ``timeout_s``)."""
        if self._dead is None:
            seq = next(self._status_seq)
            self._post(StatusRequest(seq))
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

    @property
    def error(self) -> str | None:
        return self._dead

    def num_in_flight(self) -> int:
        return len(self._requests)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort what is in flight, stop the IO thread; stop and kill an owned actor."""
        for request_id in list(self._requests):
            self.abort_request(request_id)
        self._stopping.set()
        self._io.join(timeout=5.0)
        self._fail_all("the client was shut down")
        self._ctx.destroy(linger=0)
        if self._owns_actor and self.actor is not None:
            import ray

            try:
                ray.get(self.actor.shutdown.remote(), timeout=timeout_s)
            except Exception as exc:  # already dead, or stuck: the kill below settles it
                logger.debug("controller shutdown: %r", exc)
            ray.kill(self.actor, no_restart=True)
            self._remove_placement_group()

    def _remove_placement_group(self) -> None:
        """Remove the (dead) controller's worker placement group: Ray keeps a placement group
        whose creating actor died for as long as the creator's job lives."""
        import ray
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        for pg_hex in list(self._placement_groups):
            try:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_hex))))
            except Exception as exc:  # already removed, or Ray is going away
                logger.debug("removing placement group %s: %r", pg_hex, exc)

    # ------------------------------------------------------------------ IO thread
    def _post(self, msg: Any) -> None:
        self._outgoing.put(encode(msg))
        with self._lock:
            if not self._stopping.is_set():
                try:
                    self._wake_tx.send(b"", flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # wake-ups are queued already; the IO thread sends everything

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while not self._stopping.is_set() and self._dead is None:
                events = dict(poller.poll(100))
                if self._wake_rx in events:
                    self._send_outgoing()
                if self._sock in events:
                    for _ in range(1000):
                        try:
                            frame = self._sock.recv(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._last_rx = time.monotonic()
                        self._on_frame(frame)
                if self._monitor in events:
                    recv_monitor_message(self._monitor)
                    self._check_alive("the connection to the controller dropped", at_once=True)
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self._heartbeat_s
                    self._outgoing.put(encode(StatusRequest(0)))
                    self._send_outgoing()
                    if now - self._last_rx > self._dead_after_s:
                        self._check_alive(f"no word from the controller for {self._dead_after_s} s")
            self._send_outgoing()  # the aborts of a shutdown
        except Exception as exc:
            logger.exception("client IO thread died")
            self._fail_all(f"client IO failed: {exc!r}")

    def _send_outgoing(self) -> None:
        while True:
            try:
                self._wake_rx.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
        while True:
            try:
                frame = self._outgoing.get_nowait()
            except queue.Empty:
                return
            try:
                self._sock.send(frame, flags=zmq.NOBLOCK)
            except zmq.Again:
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
                self._fail_all(f"{reason}: the controller actor is gone ({type(exc).__name__})")
                if self._owns_actor:
                    self._remove_placement_group()
                return
        if not at_once and time.monotonic() - self._last_rx > self._dead_after_s:
            self._fail_all(reason)

    def _on_frame(self, frame: bytes) -> None:
        try:
            msg = decode(frame)
        except MessageDecodeError as exc:
            logger.warning("dropping a bad frame from the controller: %s", exc)
            return
        if isinstance(msg, OutputBatch):
            for delta, starts in zip(msg.outputs, msg.text_starts, strict=True):
                self._deliver(delta, starts)
        elif isinstance(msg, AddResult):
            with self._lock:
                futs = self._adds.get(msg.request_id)
                fut = futs.popleft() if futs else None
                if futs is not None and not futs:
                    del self._adds[msg.request_id]
                if msg.error_type is not None:
                    self._requests.pop(msg.request_id, None)
            if fut is not None:
                if msg.error_type is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(error_from_result(msg))
        elif isinstance(msg, EngineStatus):
            pg = msg.stats.get("placement_group")
            if pg:
                self._placement_groups.add(pg)
            with self._status_cv:
                if msg.seq != 0 or self._status is None:
                    self._status = msg
                elif self._status is not None:
                    self._status = EngineStatus(msg.healthy, msg.stats, msg.error,
                                                self._status.seq)
                self._status_cv.notify_all()
            if not msg.healthy:
                self._fail_all(msg.error or "the engine reported itself unhealthy")

    def _deliver(self, delta: RequestOutput, starts: list[int]) -> None:
        tracked = self._requests.get(delta.request_id)
        if tracked is None:
            return
        out = tracked.merge(delta, starts)
        if out.finished:
            with self._lock:
                self._requests.pop(delta.request_id, None)
        try:
            tracked.sink(out)
        except Exception:  # a broken front end must not take the client down
            logger.exception("output sink of request %s failed", delta.request_id)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = reason
            requests, self._requests = self._requests, {}
            adds, self._adds = self._adds, {}
        for futs in adds.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(EngineDeadError(reason))
        for request_id, tracked in requests.items():
            out = failed_output(request_id, tracked.prompt_token_ids, tracked.n, reason)
            out.prompt = tracked.prompt
            try:
                tracked.sink(out)
            except Exception:
                logger.exception("output sink of request %s failed", request_id)
        with self._status_cv:
            self._status_cv.notify_all()
