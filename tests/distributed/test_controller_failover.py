"""Ray controller actors killed mid-stream, with the scripted engine (no model, so a new
controller starts in about a second): on two data-parallel replicas the killed one's streams
go on at the other, with the tokens of an uninterrupted run (a final-only request from its
prompt, in one delta); past the restart cap every request ends with a typed error, none hangs,
and new ones are refused."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from typing import Any

import helpers.fake_executor as fake_executor
import helpers.scripted as scripted
import pytest
import ray

from pagedserve.cluster.launch import start_controllers
from pagedserve.cluster.router import Router
from pagedserve.config import from_flat
from pagedserve.controller.errors import EngineDeadError
from pagedserve.controller.outputs import OutputAccumulator
from pagedserve.controller.restarts import RestartPolicy
from pagedserve.messages import AddRequest, RequestOutput, SamplingParams

LONG = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def by_value(ray_local) -> Iterator[None]:
    """The scripted engine travels to the controller actors by value."""
    ray.cloudpickle.register_pickle_by_value(fake_executor)
    ray.cloudpickle.register_pickle_by_value(scripted)
    yield
    ray.cloudpickle.unregister_pickle_by_value(scripted)
    ray.cloudpickle.unregister_pickle_by_value(fake_executor)


def _start(dp: int, policy: Callable[[], RestartPolicy]) -> Router:
    config = from_flat(block_size=4, num_gpu_blocks=96, max_model_len=96, max_num_seqs=8,
                       max_num_batched_tokens=32, data_parallel_size=dp)
    return start_controllers(config, scripted.build_scripted_engine, model_name="scripted",
                             reserve_workers=False, restart_policy=policy)


class Streams:
    """Requests submitted to ``router``; each one's cumulative output and token count."""

    def __init__(self, router: Router, n: int) -> None:
        self.finals: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self.tokens: dict[str, int] = {}
        self.errors = 0
        self.requests = [AddRequest(f"s{i}", [10 + i] * (4 + i), LONG) for i in range(n)]
        for r in self.requests:
            router.add_request(r, self._sink(r))

    def _sink(self, r: AddRequest) -> Any:
        acc = OutputAccumulator(r.request_id, None, r.prompt_token_ids, 1)

        def sink(delta) -> None:
            out = acc.add(delta)
            self.errors += delta.error is not None
            self.tokens[r.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                self.finals.put(out)

        return sink

    def wait_tokens(self, at_least: int) -> dict[str, int]:
        deadline = time.monotonic() + 60
        while len(self.tokens) < len(self.requests) or min(self.tokens.values()) < at_least:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        return dict(self.tokens)

    def finished(self, timeout_s: float = 60.0) -> dict[str, RequestOutput]:
        got: dict[str, RequestOutput] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(self.requests):
            out = self.finals.get(timeout=max(0.01, deadline - time.monotonic()))
            got[out.request_id] = out
        return got


def test_two_replicas_one_killed_its_streams_go_on_at_the_other(by_value) -> None:
    router = _start(2, lambda: RestartPolicy(backoff_s=0.01))
    try:
        streams = Streams(router, 6)
        lost = [r.request_id for r in streams.requests if router.replica_of(r.request_id) == 0]
        assert lost and len(lost) < len(streams.requests)
        at_kill = streams.wait_tokens(2)
        ray.kill(router.replicas[0].actor, no_restart=True)
        finals = streams.finished()
        assert streams.errors == 0
        for r in streams.requests:
            out = finals[r.request_id].outputs[0]
            assert out.token_ids == scripted.greedy_after(r.prompt_token_ids[-1], 80), r.request_id
            assert out.finish_reason == "length"
        assert min(at_kill[rid] for rid in lost) < 80  # the kill landed mid-stream
        assert {rid for rid, _, why in router.routes if why == "moved"} == set(lost)
        deadline = time.monotonic() + 60
        while not router.replicas[0].is_healthy():  # and the replica is back
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert router.stats()["num_controller_restarts"] == 1
    finally:
        router.shutdown()


def test_final_only_requests_start_over_at_the_other_replica(by_value) -> None:
    """A final-only request (``LLM.generate``'s) has received nothing when its controller is
    lost: the other replica runs it from its prompt, and its one delta is the whole answer."""
    router = _start(2, lambda: RestartPolicy(backoff_s=0.01))
    try:
        streams = Streams(router, 4)  # per-step deltas: they show the kill landing mid-stream
        quiet = [AddRequest(f"q{i}", [20 + i] * (4 + i), LONG, final_only=True) for i in range(4)]
        finals: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        deltas: dict[str, int] = {}
        for r in quiet:
            acc = OutputAccumulator(r.request_id, None, r.prompt_token_ids, 1)

            def sink(delta, acc=acc) -> None:
                deltas[delta.request_id] = deltas.get(delta.request_id, 0) + 1
                if acc.add(delta).finished:
                    finals.put(acc.output)

            router.add_request(r, sink)
        lost = {r.request_id for r in quiet if router.replica_of(r.request_id) == 0}
        assert lost
        streams.wait_tokens(2)
        ray.kill(router.replicas[0].actor, no_restart=True)
        streams.finished()
        got: dict[str, RequestOutput] = {}
        while len(got) < len(quiet):
            out = finals.get(timeout=60)
            got[out.request_id] = out
        for r in quiet:
            out = got[r.request_id]
            assert out.error is None and out.outputs[0].finish_reason == "length"
            assert out.outputs[0].token_ids == scripted.greedy_after(r.prompt_token_ids[-1], 80)
        assert deltas == {r.request_id: 1 for r in quiet}
        assert lost <= {rid for rid, _, why in router.routes if why == "moved"}
    finally:
        router.shutdown()


def test_past_the_restart_cap_every_request_ends_with_a_typed_error(by_value) -> None:
    router = _start(1, lambda: RestartPolicy(max_restarts=1, backoff_s=0.01))
    replica = router.replicas[0]
    try:
        streams = Streams(router, 3)
        streams.wait_tokens(2)
        first = replica.actor
        ray.kill(first, no_restart=True)
        deadline = time.monotonic() + 60
        while replica.actor in (None, first):  # a new controller took the streams over
            assert time.monotonic() < deadline
            time.sleep(0.02)
        ray.kill(replica.actor, no_restart=True)  # lost twice: past the cap
        t0 = time.monotonic()
        finals = streams.finished(timeout_s=30)
        assert time.monotonic() - t0 < 15
        for out in finals.values():
            assert out.error_code == EngineDeadError.__name__ and "restarts" in (out.error or "")
            assert out.outputs[0].finish_reason == "error"
        assert not router.is_healthy()
        with pytest.raises(EngineDeadError):
            router.add_request(AddRequest("after", [1, 2], LONG), lambda d: None)
    finally:
        router.shutdown()
