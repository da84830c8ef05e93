"""A lost controller costs its requests a pause, over in-process engines (no Ray, no sockets):
the router moves them, resumed, to a live replica or to the replica's new controller, and
their streams join up to an uninterrupted run's; past the restart cap every request ends with
a typed error, none hangs, and the HTTP server answers 503 with ``Retry-After``."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import httpx2 as httpx
import pytest
from helpers.fake_executor import FakeExecutor

from pagedserve.cluster.replica import Replica
from pagedserve.cluster.router import Router
from pagedserve.config import from_flat
from pagedserve.controller.client import LocalEngineClient
from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.errors import ControllerLostError, EngineDeadError
from pagedserve.controller.loop import EngineLoop
from pagedserve.controller.outputs import OutputAccumulator
from pagedserve.controller.restarts import RestartPolicy
from pagedserve.messages import AddRequest, RequestDelta, RequestOutput, SamplingParams
from pagedserve.serving.openai.server import build_app

CONFIG = from_flat(block_size=4, num_gpu_blocks=96, max_model_len=128, max_num_seqs=8,
                   max_num_batched_tokens=32)
WORKLOAD = [
    AddRequest(f"g{i}", [3 + i] * (5 + 4 * i), SamplingParams(max_tokens=24, ignore_eos=True))
    for i in range(4)
] + [
    AddRequest("seeded", [50] * 9, SamplingParams(max_tokens=20, seed=11, temperature=1.0,
                                                  ignore_eos=True)),
    AddRequest("pair", [60, 61, 62, 63, 64, 65], SamplingParams(n=2, seed=5, max_tokens=16,
                                                                ignore_eos=True)),
]


class Controller(LocalEngineClient):
    """An in-process controller that can be lost the way ``RemoteEngineClient`` reports it:
    its requests fail with ``ControllerLostError``, then ``on_lost``."""

    def __init__(self, on_lost: Callable[[str], None]) -> None:
        engine = EngineCore(CONFIG, FakeExecutor(step_s=0.01), tokenizer=None, eos_token_ids=())
        super().__init__(EngineLoop(engine), "fake")
        self._on_lost = on_lost

    def lose(self, reason: str = "the controller actor is gone (ActorDiedError)",
             between: Callable[[], None] | None = None) -> None:
        """``between`` runs where the requests have failed and ``on_lost`` is still to come."""
        self._fail_all(reason, ControllerLostError)
        if between is not None:
            between()
        self._on_lost(reason)


class Stream:
    """One request's deltas as its client sees them, joined into the cumulative output."""

    def __init__(self, request: AddRequest) -> None:
        self.acc = OutputAccumulator(request.request_id, None, request.prompt_token_ids,
                                     request.params.n)
        self.deltas: list[RequestDelta] = []
        self.done = threading.Event()

    def __call__(self, delta: RequestDelta) -> None:
        self.deltas.append(delta)
        self.acc.add(delta)
        if delta.finished:
            self.done.set()

    @property
    def tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.acc.output.outputs)


class Cluster:
    """Replicas of ``Controller``s behind a router; ``starts`` lists every controller made."""

    def __init__(self, n: int, policy: Callable[[], RestartPolicy], *,
                 restart_gate: threading.Event | None = None,
                 restart_fails: bool = False) -> None:
        self.starts: list[list[Controller]] = [[] for _ in range(n)]
        self.gate, self.fails = restart_gate, restart_fails
        self.router = Router([
            Replica(i, lambda lost, i=i: self._start(i, lost),
                    restart=lambda lost, i=i: self._restart(i, lost), restarts=policy())
            for i in range(n)
        ], block_size=4)

    def _start(self, i: int, on_lost: Callable[[str], None]) -> Controller:
        self.starts[i].append(Controller(on_lost))
        return self.starts[i][-1]

    def _restart(self, i: int, on_lost: Callable[[str], None]) -> Controller:
        if self.gate is not None:
            self.gate.wait(30)
        if self.fails:
            raise RuntimeError("no node can take the controller")
        return self._start(i, on_lost)

    def submit(self, requests: list[AddRequest]) -> dict[str, Stream]:
        streams = {r.request_id: Stream(r) for r in requests}
        for r in requests:
            self.router.wait_added(self.router.submit(r, streams[r.request_id]))
        return streams


def _reference() -> dict[str, RequestOutput]:
    cluster = Cluster(1, RestartPolicy)
    try:
        streams = cluster.submit(WORKLOAD)
        assert all(s.done.wait(30) for s in streams.values())
        return {rid: s.acc.output for rid, s in streams.items()}
    finally:
        cluster.router.shutdown()


@pytest.fixture(scope="module")
def reference() -> dict[str, RequestOutput]:
    return _reference()


def _wait(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _check_uninterrupted(streams: dict[str, Stream], reference) -> None:
    for rid, s in streams.items():
        assert s.done.wait(30), rid
        assert not [d for d in s.deltas if d.error is not None], rid
        assert sum(d.finished for d in s.deltas) == 1
        assert s.acc.output == reference[rid], rid


def test_one_replica_its_streams_wait_for_the_new_controller(reference) -> None:
    cluster = Cluster(1, lambda: RestartPolicy(backoff_s=0.01))
    router = cluster.router
    try:
        streams = cluster.submit(WORKLOAD)
        _wait(lambda: all(s.tokens >= 3 for s in streams.values()))
        cluster.starts[0][0].lose()
        assert router.is_healthy()  # coming back: requests wait, new ones too
        late = cluster.submit([AddRequest("late", [9] * 6, SamplingParams(
            max_tokens=5, ignore_eos=True))])
        _check_uninterrupted(streams, reference)
        assert late["late"].done.wait(30) and late["late"].acc.output.error is None
        stats = router.stats()
        assert stats["num_controller_restarts"] == 1 and len(cluster.starts[0]) == 2
        assert stats["num_requests_moved"] >= len(WORKLOAD) - 1
        assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0
    finally:
        router.shutdown()


def test_a_request_sent_while_the_loss_is_being_reported_waits_for_the_new_controller() -> None:
    """The client fails a lost controller's requests before it tells the replica: a request
    sent in between, and a health check, find the replica coming back, not dead."""
    cluster = Cluster(1, lambda: RestartPolicy(backoff_s=0.01))
    router = cluster.router
    late = AddRequest("late", [9] * 6, SamplingParams(max_tokens=5, ignore_eos=True))
    stream, seen = Stream(late), {}

    def between() -> None:
        seen["healthy"] = router.is_healthy()
        seen["added"] = router.submit(late, stream)

    try:
        cluster.starts[0][0].lose(between=between)
        router.wait_added(seen["added"])
        assert seen["healthy"]
        assert stream.done.wait(30) and stream.acc.output.error is None
        assert stream.tokens == 5 and len(cluster.starts[0]) == 2
    finally:
        router.shutdown()


def test_two_replicas_the_lost_ones_requests_go_on_at_the_other(reference) -> None:
    gate = threading.Event()  # replica 0's new controller starts only once the test says so
    cluster = Cluster(2, lambda: RestartPolicy(backoff_s=0.01), restart_gate=gate)
    router = cluster.router
    try:
        streams = cluster.submit(WORKLOAD)
        on_zero = [rid for rid in streams if router.replica_of(rid) == 0]
        assert on_zero and len(on_zero) < len(streams)
        _wait(lambda: all(s.tokens >= 2 for s in streams.values()))
        cluster.starts[0][0].lose()
        # They finish on replica 1 while replica 0 is still without a controller.
        _check_uninterrupted(streams, reference)
        assert router.replicas[0].restarting and router.is_healthy()
        assert {rid for rid, r, why in router.routes if why == "moved"} == set(on_zero)
        gate.set()
        _wait(lambda: router.replicas[0].is_healthy())
        assert router.stats()["num_controller_restarts"] == 1
    finally:
        gate.set()
        router.shutdown()


@pytest.mark.parametrize("restart_fails", [False, True])
def test_past_the_cap_every_request_ends_with_a_typed_error(restart_fails: bool) -> None:
    # One restart allowed: a controller lost twice (or one whose replacement never starts,
    # then refused by the policy) leaves no replica.
    cluster = Cluster(1, lambda: RestartPolicy(max_restarts=1, backoff_s=0.01),
                      restart_fails=restart_fails)
    router = cluster.router
    try:
        streams = cluster.submit(WORKLOAD[:3])
        _wait(lambda: all(s.tokens >= 2 for s in streams.values()))
        cluster.starts[0][0].lose()
        if not restart_fails:
            _wait(lambda: router.replicas[0].is_healthy())
            _wait(lambda: all(s.tokens >= 4 for s in streams.values()))
            cluster.starts[0][1].lose()
        for s in streams.values():
            assert s.done.wait(30)
            out = s.acc.output
            assert out.error_code == EngineDeadError.__name__ and "no data-parallel replica" in (
                out.error or "")
            assert [c.finish_reason for c in out.outputs] == ["error"]
        assert not router.is_healthy() and "restarts" in (router.error or "")
        with pytest.raises(EngineDeadError):
            cluster.submit([AddRequest("after", [1, 2], SamplingParams(max_tokens=2))])

        async def answers() -> tuple[httpx.Response, int]:
            transport = httpx.ASGITransport(app=build_app(router))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                resp = await http.post("/v1/completions", json={"prompt": [1, 2, 3]})
                return resp, (await http.get("/health")).status_code

        resp, health = asyncio.run(answers())
        assert resp.status_code == 503 and health == 503
        assert resp.json()["error"]["code"] == "engine_unavailable"
        assert int(resp.headers["Retry-After"]) > 0
    finally:
        router.shutdown()


def test_a_request_waiting_for_a_replica_can_be_aborted() -> None:
    gate = threading.Event()
    cluster = Cluster(1, lambda: RestartPolicy(backoff_s=0.01), restart_gate=gate)
    router = cluster.router
    try:
        (stream,) = cluster.submit(WORKLOAD[:1]).values()
        _wait(lambda: stream.tokens >= 2)
        cluster.starts[0][0].lose()
        _wait(lambda: router.replica_of("g0") is None)
        router.abort_request("g0")
        assert stream.done.is_set()
        assert stream.acc.output.outputs[0].finish_reason == "abort"
        assert stream.acc.output.error is None
    finally:
        gate.set()
        router.shutdown()


def test_a_request_over_before_its_verdict_is_seen_is_still_accepted() -> None:
    """The client resolves an add's future and then hands over the deltas of the same batch:
    a request that finishes in it is over before the router looks at its verdict."""

    class Instant(Controller):
        def submit(self, request, sink):
            fut = super().submit(request, lambda delta: None)
            fut.result(timeout=30)
            sink(RequestDelta(request.request_id, [], finished=True))
            return fut

    router = Router([Replica(0, Instant)], block_size=4)
    try:
        router.wait_added(router.submit(AddRequest("r", [1, 2], SamplingParams(max_tokens=1)),
                                        lambda delta: None), timeout_s=5)
        assert router.replica_of("r") is None and router.stats()["replicas"][0]["in_flight"] == 0
    finally:
        router.shutdown()
