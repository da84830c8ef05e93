"""``Router``: one ``EngineClient`` in front of data-parallel replicas, prefix-aware.

Each replica has its own prefix cache, so a request should go where its prefix was computed.
The router keys a request by the chained hash (``kv.hashing``, cache salt included) of its
first ``prefix_blocks`` full blocks and sends it to the replica that key is **sticky** to; a
key seen for the first time is placed by rendezvous hashing over the healthy replicas, so
placement is stable and spreads evenly. The preferred replica is overridden when it is much
busier than the least loaded one (``load > overload_factor * least + overload_slack``): the
request then goes to the least loaded replica, and the key becomes sticky there. Prompts
shorter than one block carry no reusable prefix and go to the least loaded replica.

Load is what the router itself has in flight on each replica (it sees every add and every
final output), which is exact for requests of this router and immediate, unlike a polled
status. Dead replicas are skipped; the router stays healthy while one replica is.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from pagedserve.controller.client import EngineClient, Sink
from pagedserve.controller.errors import DuplicateRequestError, EngineDeadError
from pagedserve.kv.hashing import BlockHasher
from pagedserve.messages import AddRequest, RequestDelta

__all__ = ["Router"]

logger = logging.getLogger(__name__)


class Router:
    """Routes requests over ``replicas`` (each an ``EngineClient``); see the module docstring."""

    def __init__(
        self,
        replicas: Sequence[EngineClient],
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
        self.replicas = list(replicas)
        first = self.replicas[0]
        self.model_name = first.model_name
        self.max_model_len = first.max_model_len
        self.vocab_size = first.vocab_size
        self.tokenizer = first.tokenizer
        self.block_size = block_size
        self.prefix_blocks = prefix_blocks
        self.overload_factor = overload_factor
        self.overload_slack = overload_slack
        self._hasher = BlockHasher(block_size)
        self._lock = threading.Lock()
        self._sticky: OrderedDict[bytes, int] = OrderedDict()
        self._max_sticky = max_sticky
        self._where: dict[str, int] = {}
        self._load = [0] * len(self.replicas)
        self.routes: deque[tuple[str, int, str]] = deque(maxlen=log_size)
        """Recent decisions: ``(request_id, replica, reason)``, reason one of ``prefix``,
        ``new-prefix``, ``overload``, ``no-prefix``."""

    # ------------------------------------------------------------------ policy
    def prefix_key(self, prompt_token_ids: Sequence[int], cache_salt: str | None) -> bytes | None:
        full = min(len(prompt_token_ids) // self.block_size, self.prefix_blocks)
        if full == 0:
            return None
        hashes: list[bytes] = []
        self._hasher.extend(hashes, list(prompt_token_ids[: full * self.block_size]), cache_salt)
        return hashes[-1]

    def _choose(self, key: bytes | None) -> tuple[int, str]:
        healthy = [i for i, r in enumerate(self.replicas) if r.is_healthy()]
        if not healthy:
            raise EngineDeadError("every data-parallel replica is down")
        least = min(healthy, key=lambda i: self._load[i])
        if key is None:
            return least, "no-prefix"
        preferred = self._sticky.get(key)
        reason = "prefix"
        if preferred is None or preferred not in healthy:
            preferred = max(healthy, key=lambda i: hashlib.sha256(key + bytes([i % 256])).digest())
            reason = "new-prefix"
        limit = self.overload_factor * self._load[least] + self.overload_slack
        if preferred != least and self._load[preferred] > limit:
            preferred, reason = least, "overload"
        self._sticky[key] = preferred
        self._sticky.move_to_end(key)
        while len(self._sticky) > self._max_sticky:
            self._sticky.popitem(last=False)
        return preferred, reason

    # ------------------------------------------------------------------ EngineClient
    def add_request(self, request: AddRequest, sink: Sink) -> None:
        self.wait_added(self.submit(request, sink))

    def submit(self, request: AddRequest, sink: Sink) -> Future[None]:
        """Route and send without waiting for the verdict; ``wait_added(future)`` raises what
        ``add_request`` would have."""
        rid = request.request_id
        index, reason = self._route(rid, request.prompt_token_ids, request.cache_salt)
        try:
            fut = self.replicas[index].submit(request, self._tracking(rid, index, sink))
        except BaseException:
            self._release(rid, index)
            raise

        def settle(f: Future[None]) -> None:
            if f.exception() is not None:
                self._release(rid, index)
            else:
                self.routes.append((rid, index, reason))

        fut.add_done_callback(settle)
        return fut

    def wait_added(self, fut: Future[None], timeout_s: float = 120.0) -> None:
        # A replica's client resolves its pending adds itself when it finds the replica dead.
        try:
            fut.result(timeout=timeout_s)
        except TimeoutError:
            raise EngineDeadError(f"no answer to an add within {timeout_s} s") from None

    def _route(
        self, request_id: str, prompt_token_ids: Sequence[int], cache_salt: str | None
    ) -> tuple[int, str]:
        key = self.prefix_key(prompt_token_ids, cache_salt)
        with self._lock:
            if request_id in self._where:
                raise DuplicateRequestError(f"request id {request_id!r} is already in use")
            index, reason = self._choose(key)
            self._where[request_id] = index
            self._load[index] += 1
        return index, reason

    def _tracking(self, request_id: str, index: int, sink: Sink) -> Sink:
        def on_output(out: RequestDelta) -> None:
            if out.finished:
                self._release(request_id, index)
            sink(out)

        return on_output

    def _release(self, request_id: str, index: int) -> None:
        with self._lock:
            if self._where.get(request_id) == index:
                del self._where[request_id]
                self._load[index] -= 1

    def abort_request(self, request_id: str) -> None:
        index = self._where.get(request_id)
        if index is not None:
            self.replicas[index].abort_request(request_id)

    def replica_of(self, request_id: str) -> int | None:
        return self._where.get(request_id)

    def stats(self) -> dict[str, Any]:
        """Numeric stats summed over replicas, plus ``replicas`` (each one's own, with its
        ``healthy`` flag and the router's ``in_flight`` count)."""
        per: list[dict[str, Any]] = []
        total: dict[str, Any] = {}
        for i, replica in enumerate(self.replicas):
            s = dict(replica.stats())
            s["healthy"] = replica.is_healthy()
            s["in_flight"] = self._load[i]
            per.append(s)
            for k, v in s.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    total[k] = total.get(k, 0) + v
        total["replicas"] = per
        return total

    def is_healthy(self) -> bool:
        return any(r.is_healthy() for r in self.replicas)

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
