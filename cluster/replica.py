"""``Replica``: one data-parallel replica's controller, started again when it is lost.

The launcher starts each replica's first controller. When the replica's client finds it lost
(``RemoteEngineClient``'s ``on_lost``: the actor died, its node went, or it fell silent and was
killed), a thread starts another one in the same placement group after the restart policy's
backoff; past the policy's cap the replica is dead for good. The replica's requests are the
``Router``'s business: their error deltas (``ControllerLostError``) tell it to move them to a
live replica, or to wait for this one, which ``watch`` announces back (or dead).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pagedserve.cluster.remote_client import RemoteEngineClient
from pagedserve.controller.client import ClientBase, EngineClient, Sink
from pagedserve.controller.errors import ControllerLostError, EngineDeadError
from pagedserve.controller.restarts import RestartPolicy
from pagedserve.messages import AddRequest

__all__ = ["Connect", "Replica", "ReplicaState"]

logger = logging.getLogger(__name__)

Connect = Callable[[Callable[[str], None]], EngineClient]
"""``connect(on_lost) -> client``: a client of a (new) controller that calls ``on_lost(reason)``
once when it finds that controller lost."""


class ReplicaState(enum.Enum):
    LIVE = "live"
    RESTARTING = "restarting"
    DEAD = "dead"  # lost past the restart policy, or lost with no way to restart
    CLOSED = "closed"


class Replica:
    """One replica's controller behind the calls the ``Router`` makes (see the module
    docstring). ``connect`` gives the first controller's client; ``restart``, called on a
    thread of this replica, starts a new controller and gives its client (None: a replica that
    cannot be replaced, dead once lost); ``close`` frees what the replica holds besides its
    controller (its placement group), at shutdown."""

    def __init__(
        self,
        index: int,
        connect: Connect,
        *,
        restart: Connect | None = None,
        restarts: RestartPolicy | None = None,
        close: Callable[[], None] | None = None,
    ) -> None:
        self.index = index
        self.restarts = restarts or RestartPolicy()
        self.state = ReplicaState.LIVE
        self._reason: str | None = None  # why the last controller was lost, or why dead
        self.num_restarts = 0
        self._restart = restart
        self._close = close
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._watchers: list[Callable[[Replica], None]] = []
        self._thread: threading.Thread | None = None
        self._client: EngineClient | None = None
        self._client = first = connect(self._lost)
        self.model_name = first.model_name
        self.max_model_len = first.max_model_len
        self.vocab_size = first.vocab_size
        self.block_size = first.block_size
        self.tokenizer = first.tokenizer

    # ------------------------------------------------------------------ the router's calls
    @property
    def client(self) -> EngineClient | None:
        """The live controller's client (None while restarting, dead or closed)."""
        return self._client if self.state is ReplicaState.LIVE else None

    @property
    def actor(self) -> Any:
        """The live controller's Ray handle (None without one)."""
        client = self.client
        return client.actor if isinstance(client, RemoteEngineClient) else None

    @property
    def restarting(self) -> bool:
        """A new controller starts, or is about to: the client fails a lost controller's
        requests before it calls ``_lost``, and a request that comes meanwhile must wait for
        the new one, not find the replica dead."""
        if self.state is ReplicaState.RESTARTING:
            return True
        client = self._client
        return (self.state is ReplicaState.LIVE and self.replaceable
                and isinstance(client, ClientBase) and client.lost)

    @property
    def replaceable(self) -> bool:
        """A lost controller is replaced (else the replica is dead once lost)."""
        return self._restart is not None

    def watch(self, callback: Callable[[Replica], None]) -> None:
        """Call ``callback(self)`` (on a thread of this replica) when it is back or dead."""
        self._watchers.append(callback)

    def submit(self, request: AddRequest, sink: Sink) -> Future[None]:
        """The live client's ``submit``; ``ControllerLostError`` while a new controller
        starts, ``EngineDeadError`` once the replica is dead."""
        client = self.client
        if client is None:
            error = ControllerLostError if self.restarting else EngineDeadError
            raise error(self._reason or f"replica {self.index} is {self.state.value}")
        return client.submit(request, sink)

    def abort_request(self, request_id: str) -> None:
        client = self.client
        if client is not None:
            client.abort_request(request_id)

    def stats(self) -> dict[str, Any]:
        client = self.client
        stats = dict(client.stats()) if client is not None else {}
        stats["num_controller_restarts"] = self.num_restarts
        return stats

    def is_healthy(self) -> bool:
        client = self.client
        return client is not None and client.is_healthy()

    @property
    def error(self) -> str | None:
        """Why the replica does not serve (None when it does)."""
        client = self.client
        return client.error if client is not None else self._reason

    def shutdown(self) -> None:
        with self._lock:
            self.state, client = ReplicaState.CLOSED, self._client
        self._closing.set()
        try:
            if client is not None:
                client.shutdown()
            if self._thread is not None:
                # A start in progress sees CLOSED and stops what it started; the placement
                # group's removal below makes a later one fail.
                self._thread.join(timeout=5.0)
        finally:
            if self._close is not None:
                self._close()

    # ------------------------------------------------------------------ restarts
    def _lost(self, reason: str) -> None:
        """The client's ``on_lost``, called once its requests have failed: start the
        replacement on a thread of its own (this is the lost client's IO thread)."""
        with self._lock:
            if self.state is not ReplicaState.LIVE:
                return
            self.state, self._reason, old = ReplicaState.RESTARTING, reason, self._client
        self._thread = threading.Thread(target=self._replace, args=(old, reason),
                                        name=f"pagedserve-replica-{self.index}", daemon=True)
        self._thread.start()

    def _replace(self, old: EngineClient | None, reason: str) -> None:
        if old is not None:
            _quietly(old.shutdown)  # its sockets and IO thread; the controller is gone
        while not self._closing.is_set():
            delay = self.restarts.on_failure()
            if delay is None or self._restart is None:
                self._settle(None, f"replica {self.index} lost its controller "
                             f"{self.restarts.recent_failures} times within "
                             f"{self.restarts.window_s:.0f} s (at most "
                             f"{self.restarts.max_restarts} restarts); last: {reason}")
                return
            logger.warning("replica %d: %s; starting a new controller in %.1f s",
                           self.index, reason, delay)
            if self._closing.wait(delay):
                return
            try:
                client = self._restart(self._lost)
            except Exception as exc:
                logger.warning("replica %d: a new controller did not start: %r", self.index, exc)
                reason = f"starting a new controller failed: {exc}"
                continue
            self._settle(client, None)
            return

    def _settle(self, client: EngineClient | None, dead: str | None) -> None:
        with self._lock:
            closed = self.state is ReplicaState.CLOSED
            if not closed:
                if client is not None:
                    self._client, self.state, self._reason = client, ReplicaState.LIVE, None
                    self.num_restarts += 1
                else:
                    self._client, self.state, self._reason = None, ReplicaState.DEAD, dead
        if closed:
            if client is not None:
                _quietly(client.shutdown)
            return
        if client is not None:
            logger.warning("replica %d: serving again on a new controller (restart %d)",
                           self.index, self.num_restarts)
        else:
            logger.error("replica %d is dead: %s", self.index, dead)
        for callback in list(self._watchers):
            try:
                callback(self)
            except Exception:
                logger.exception("replica %d: a watcher failed", self.index)


def _quietly(call: Callable[[], None]) -> None:
    try:
        call()
    except Exception as exc:  # tearing down what is already gone
        logger.debug("teardown: %r", exc)
