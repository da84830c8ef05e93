"""``Router``: one ``EngineClient`` in front of the data-parallel replicas (one or several)
that sends each request where its prefix is (``cluster.routing``) and moves a lost
controller's requests to a live replica.

The load the policy weighs is what the router itself has in flight on each replica (it sees
every add and every final output), which is exact for requests of this router and immediate,
unlike a polled status.

Failover: the router keeps each request until its final delta, with what its client has
received (``controller.resume``). When a replica's controller is lost, its requests' error
deltas (``ControllerLostError``) are not passed on: each request goes to a live replica as a
resumed request, or, when none is live, waits for a replica that is starting a new controller
(``cluster.replica``), one server-wide code path for any number of replicas. A stream sees a
pause. Only when no replica is live or coming back do requests end with ``EngineDeadError``
(and new ones are refused with it: the HTTP server's 503). The router is healthy while a
replica serves or is coming back.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

from pagedserve.cluster.replica import Replica
from pagedserve.cluster.routing import PrefixPolicy
from pagedserve.controller.client import EngineClient, Sink
from pagedserve.controller.errors import (
    ControllerLostError,
    DuplicateRequestError,
    EngineDeadError,
    error_code,
)
from pagedserve.controller.outputs import failed_delta
from pagedserve.controller.resume import ResumeTracker
from pagedserve.messages import AddRequest, CompletionDelta, RequestDelta

__all__ = ["Router"]

logger = logging.getLogger(__name__)

_LOST = ControllerLostError.__name__


@dataclasses.dataclass(eq=False)
class _Flight:
    """A request from its submission to its final delta. ``attempt`` counts its submissions:
    callbacks of an earlier one (a lost controller's) are ignored."""

    request: AddRequest
    sink: Sink
    key: bytes | None
    added: Future[None]
    tracker: ResumeTracker
    replica: int | None = None  # None while it waits for a replica
    attempt: int = 0


class Router:
    """Routes requests over ``replicas`` (``Replica``s; a plain ``EngineClient`` is a replica
    that cannot be replaced) and moves those of a lost controller; see the module docstring."""

    def __init__(
        self,
        replicas: Sequence[Replica | EngineClient],
        block_size: int,
        *,
        prefix_blocks: int = 2,
        overload_factor: float = 2.0,
        overload_slack: int = 16,
        max_sticky: int = 100_000,
        log_size: int = 10_000,
    ) -> None:
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.replicas = [
            r if isinstance(r, Replica) else Replica(i, functools.partial(_fixed, r))
            for i, r in enumerate(replicas)
        ]
        first = self.replicas[0]
        self.model_name = first.model_name
        self.max_model_len = first.max_model_len
        self.vocab_size = first.vocab_size
        self.tokenizer = first.tokenizer
        self.block_size = block_size
        self.policy = PrefixPolicy(block_size, prefix_blocks=prefix_blocks,
                                   overload_factor=overload_factor,
                                   overload_slack=overload_slack, max_sticky=max_sticky)
        self._lock = threading.Lock()
        self._flights: dict[str, _Flight] = {}
        self._waiting: list[_Flight] = []  # lost their controller; no replica is live
        self._load = [0] * len(self.replicas)
        self.num_moved = 0
        """Requests moved off a lost controller (to another replica or a new controller)."""
        self.routes: deque[tuple[str, int, str]] = deque(maxlen=log_size)
        """Recent decisions: ``(request_id, replica, reason)``, reason one of ``prefix``,
        ``new-prefix``, ``overload``, ``no-prefix``, ``moved``."""
        for replica in self.replicas:
            replica.watch(self._on_replica)

    # ------------------------------------------------------------------ policy
    def prefix_key(self, prompt_token_ids: Sequence[int], cache_salt: str | None) -> bytes | None:
        return self.policy.prefix_key(prompt_token_ids, cache_salt)

    def _choose(self, key: bytes | None) -> tuple[int | None, str]:
        """The replica for a request of ``key`` (None when none is healthy). Under the lock."""
        healthy = [i for i, r in enumerate(self.replicas) if r.is_healthy()]
        return self.policy.choose(key, healthy, self._load)

    def _coming_back(self) -> bool:
        """A replica is starting a new controller, or is about to. Under the lock."""
        return any(r.restarting for r in self.replicas)

    # ------------------------------------------------------------------ EngineClient
    def add_request(self, request: AddRequest, sink: Sink) -> None:
        self.wait_added(self.submit(request, sink))

    def submit(self, request: AddRequest, sink: Sink) -> Future[None]:
        """Route and send without waiting for the verdict; ``wait_added(future)`` raises what
        ``add_request`` would have. While no replica is live but one is coming back, the
        request waits for it."""
        rid = request.request_id
        key = self.prefix_key(request.prompt_token_ids, request.cache_salt)
        flight = _Flight(request, sink, key, Future(), ResumeTracker(request.params.n))
        with self._lock:
            if rid in self._flights:
                raise DuplicateRequestError(f"request id {rid!r} is already in use")
            index, reason = self._choose(key)
            if index is None and not self._coming_back():
                raise EngineDeadError(f"every data-parallel replica is down: {self.error}")
            self._flights[rid] = flight
            if index is None:
                self._waiting.append(flight)
            else:
                self._assign(flight, index)
        if index is not None:
            try:
                self._send(flight, reason)
            except BaseException:
                self._drop(flight)
                raise
        return flight.added

    def wait_added(self, fut: Future[None], timeout_s: float = 120.0) -> None:
        # A replica's client resolves its pending adds itself when it finds the replica dead.
        try:
            fut.result(timeout=timeout_s)
        except TimeoutError:
            raise EngineDeadError(f"no answer to an add within {timeout_s} s") from None

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            flight = self._flights.get(request_id)
            if flight is None:
                return
            index = flight.replica
            waiting = index is None and flight in self._waiting
            if waiting:  # for a replica: it ends here
                self._waiting.remove(flight)
        if index is not None:
            self.replicas[index].abort_request(request_id)
            return
        if not waiting:  # failing this very moment
            return
        self._drop(flight)
        _resolve(flight.added)
        unfinished = flight.tracker.unfinished()
        flight.sink(RequestDelta(request_id, [CompletionDelta(i, [], "", finish_reason="abort")
                                              for i in unfinished], finished=True))

    def replica_of(self, request_id: str) -> int | None:
        flight = self._flights.get(request_id)
        return flight.replica if flight is not None else None

    def stats(self) -> dict[str, Any]:
        """Numeric stats summed over replicas, plus ``replicas`` (each one's own, with its
        ``healthy`` flag, its ``state`` and the router's ``in_flight`` count)."""
        per: list[dict[str, Any]] = []
        total: dict[str, Any] = {"num_requests_moved": self.num_moved}
        for i, replica in enumerate(self.replicas):
            s = dict(replica.stats())
            s["healthy"] = replica.is_healthy()
            s["in_flight"] = self._load[i]
            per.append(s)
            for k, v in s.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    total[k] = total.get(k, 0) + v
            s["state"] = replica.state.value
        total["replicas"] = per
        return total

    def is_healthy(self) -> bool:
        """A replica serves, or one is starting a new controller (requests wait for it)."""
        return any(r.is_healthy() or r.restarting for r in self.replicas)

    @property
    def error(self) -> str | None:
        """Why the router is down (every replica is), else None."""
        if self.is_healthy():
            return None
        return "; ".join(str(r.error) for r in self.replicas)

    def shutdown(self) -> None:
        for replica in self.replicas:
            try:
                replica.shutdown()
            except Exception:
                logger.exception("replica shutdown failed")
        with self._lock:
            waiting, self._waiting = self._waiting, []
        for flight in waiting:
            self._fail(flight, EngineDeadError("the client was shut down"))

    # ------------------------------------------------------------------ flights
    def _assign(self, flight: _Flight, index: int) -> None:
        """Under the lock: ``flight`` goes to replica ``index`` as a new attempt."""
        flight.replica = index
        flight.attempt += 1
        self._load[index] += 1

    def _send(self, flight: _Flight, reason: str) -> None:
        """Submit ``flight`` to its replica: resumed with what its client has, if anything.
        A replica found lost meanwhile moves it on; a refusal raises."""
        index, attempt = flight.replica, flight.attempt
        assert index is not None
        state = flight.tracker.state()
        request = flight.request if state is None else dataclasses.replace(
            flight.request, resume=state)
        try:
            fut = self.replicas[index].submit(
                request, functools.partial(self._on_delta, flight, attempt))
        except ControllerLostError as exc:
            self._move(flight, attempt, str(exc))
            return
        fut.add_done_callback(
            functools.partial(self._on_verdict, flight, attempt, (index, reason)))

    def _on_verdict(
        self, flight: _Flight, attempt: int, route: tuple[int, str], fut: Future[None]
    ) -> None:
        exc = fut.exception()
        if exc is None:
            # Even for an attempt that is over: a request that finished within the batch of
            # its verdict is over before this callback is added (then called at once).
            self.routes.append((flight.request.request_id, *route))
            _resolve(flight.added)
        elif attempt != flight.attempt:
            return
        elif isinstance(exc, ControllerLostError):
            self._move(flight, attempt, str(exc))
        else:
            self._fail(flight, exc)

    def _on_delta(self, flight: _Flight, attempt: int, delta: RequestDelta) -> None:
        """The sink of one attempt (on its client's thread)."""
        if attempt != flight.attempt:
            return
        if delta.error_code == _LOST:
            self._move(flight, attempt, delta.error or "the controller was lost")
            return
        flight.tracker.add(delta)
        if delta.finished:
            self._drop(flight)
        flight.sink(delta)

    def _move(self, flight: _Flight, attempt: int, why: str) -> None:
        """Take ``flight`` off its lost controller: to a live replica, to the waiting list
        (one is coming back), or to its end (none is)."""
        with self._lock:
            lost_from = flight.replica
            current = self._flights.get(flight.request.request_id) is flight
            if attempt != flight.attempt or lost_from is None or not current:
                return
            self._load[lost_from] -= 1
            flight.replica = None
            self.num_moved += 1
            index, _ = self._choose(flight.key)
            if index is not None:
                self._assign(flight, index)
            elif self._coming_back():
                self._waiting.append(flight)
                return
        if index is None:
            self._fail(flight, EngineDeadError(f"no data-parallel replica is left: {why}"))
            return
        logger.info("request %s: its controller was lost; it goes on at replica %d",
                    flight.request.request_id, index)
        self._resend(flight)

    def _resend(self, flight: _Flight) -> None:
        try:
            self._send(flight, "moved")
        except Exception as exc:  # refused where it went (a full engine): it ends here
            self._fail(flight, exc)

    def _on_replica(self, replica: Replica) -> None:
        """A replica is back (the waiting requests go on) or dead (they end, unless another
        one may still take them)."""
        with self._lock:
            waiting, self._waiting = self._waiting, []
            placed = []
            for flight in waiting:
                index, _ = self._choose(flight.key)
                if index is not None:
                    self._assign(flight, index)
                    placed.append(flight)
                elif self._coming_back():
                    self._waiting.append(flight)
                else:
                    placed.append(flight)
        for flight in placed:
            if flight.replica is None:
                self._fail(flight, EngineDeadError(f"no data-parallel replica is left: "
                                                   f"{replica.error}"))
            else:
                self._resend(flight)

    def _drop(self, flight: _Flight) -> None:
        """Forget a finished (or failed) request; later callbacks of it are ignored."""
        with self._lock:
            rid = flight.request.request_id
            if self._flights.get(rid) is flight:
                del self._flights[rid]
            if flight.replica is not None:
                self._load[flight.replica] -= 1
                flight.replica = None
            flight.attempt += 1

    def _fail(self, flight: _Flight, exc: BaseException) -> None:
        """End ``flight`` with ``exc``: its add raises it, or, once accepted, its stream ends
        with an error delta naming it."""
        self._drop(flight)
        if _resolve(flight.added, exc):
            return
        rid = flight.request.request_id
        flight.sink(failed_delta(rid, flight.tracker.unfinished(), str(exc), error_code(exc)))


def _fixed(client: EngineClient, on_lost: Any) -> EngineClient:
    """``Replica``'s connect for a client that was made without it (no restarts)."""
    return client


def _resolve(fut: Future[None], exc: BaseException | None = None) -> bool:
    """Settle ``fut`` unless it is settled already; True if this call did."""
    try:
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)
    except InvalidStateError:
        return False
    return True
