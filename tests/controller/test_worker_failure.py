"""A worker-group failure preempts everything in flight: the requests resume after the rebuild
with the tokens they would have had (no error delta, the stream only pauses), unless one ran
through more failures than its limit or the restart cap is reached (typed errors, no block
left behind in either tier)."""

from __future__ import annotations

import queue
from dataclasses import dataclass

import pytest
from helpers.fake_executor import FakeExecutor

from pagedserve.controller.client import LocalEngineClient
from pagedserve.controller.errors import EngineDeadError, RequestFailedError
from pagedserve.controller.executor import WorkerGroupError
from pagedserve.controller.loop import EngineLoop
from pagedserve.controller.restarts import RestartPolicy
from pagedserve.messages import AddRequest, RequestDelta, SamplingParams

LONG = SamplingParams(max_tokens=12, ignore_eos=True)


def prompt(start: int, n: int) -> list[int]:
    return [(start + i) % 997 + 1 for i in range(n)]


@dataclass
class Flaky(FakeExecutor):
    """A rank dies at the given ``execute`` calls (counted across rebuilds), and whenever a
    step schedules ``poison``."""

    fail_calls: tuple[int, ...] = ()
    poison: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.calls = 0
        self.failures = 0

    def execute(self, so):
        self.calls += 1
        if self.calls in self.fail_calls or self.poison in so.num_scheduled_tokens:
            self.failures += 1
            raise WorkerGroupError(1, "node-x", "the worker actor died")
        return super().execute(so)


def _workload(eng) -> None:
    # A shared prefix (prefix hits), n = 2 forked early and a long n = 2 prompt still being
    # prefilled by its fork parent, seeds, and more requests than seats (some wait).
    for i in range(4):
        eng.add_request(f"r{i}", prompt(0, 9) + prompt(50 * i, 3 + i), LONG)
    eng.add_request("pair", prompt(300, 5), SamplingParams(max_tokens=10, n=2, seed=3,
                                                           ignore_eos=True))
    eng.add_request("late-pair", prompt(400, 40), SamplingParams(max_tokens=6, n=2, seed=5,
                                                                ignore_eos=True))
    for i in range(3):
        eng.add_request(f"w{i}", prompt(600 + 9 * i, 6), SamplingParams(max_tokens=8, seed=i))


def _run(eng, stop=lambda: False, max_steps: int = 2000):
    """Step to the end (or until ``stop()``); the final outputs and each step's deltas."""
    done, steps = {}, []
    for _ in range(max_steps):
        if not eng.has_unfinished() or stop():
            break
        steps.append(eng.core.step())
        for out in eng.collector.feed(steps[-1]):
            if out.finished:
                done[out.request_id] = out
        eng.kv.check_integrity()
    return done, steps


def _errors(steps: list[list[RequestDelta]]) -> list[RequestDelta]:
    return [d for step in steps for d in step if d.error is not None]


def _tokens(outs) -> dict[str, list[list[int]]]:
    return {k: [c.token_ids for c in v.outputs] for k, v in outs.items()}


# 17 usable blocks of 4 tokens: the workload preempts (or swaps) before it ends.
ENGINE = {"num_gpu_blocks": 18, "max_num_batched_tokens": 16, "max_num_seqs": 6}


# Call 3 fails while a fork parent prefills for its children, call 10 while requests are
# preempted (swapped, with a host tier), call 20 late in decoding.
# With async scheduling (``overlap``) the failing call may find a second step in flight.
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("fail_call", [3, 10, 20])
def test_a_failure_mid_decoding_resumes_every_request(kit, swap: bool, fail_call: int,
                                                      overlap: bool) -> None:
    tier = {"num_host_blocks": 64, "preemption_mode": "swap"} if swap else {}
    ref = kit.make_engine(**ENGINE, **tier)
    _workload(ref)
    expected, _ = _run(ref)
    assert not ref.has_unfinished()

    ex = Flaky(fail_calls=(fail_call,), overlaps_steps=overlap)
    eng = kit.make_engine(executor=ex, restarts=RestartPolicy(backoff_s=0.0), **ENGINE, **tier)
    _workload(eng)
    at_failure: dict = {}  # as the failing step scheduled

    def record(sched, _) -> None:
        at_failure.update(
            queues=[r.request_id for r in (*sched.running, *sched.waiting)],
            parent=any(r.children for r in sched.running),
            preempted=sched.num_preemptions,
            swapped=len(sched.kv.host.swapped) if swap else 0,
        )

    eng.add_step_hook(record)
    done, steps = _run(eng, stop=lambda: ex.failures > 0)
    assert steps[-1] == []  # the failing step emits nothing: the streams pause
    if overlap:  # calls come at other moments: the call numbers are chosen for steps in turn
        assert ex.max_in_flight == 2
    elif fail_call == 3:
        assert at_failure["parent"]
    elif fail_call == 10:
        assert at_failure["swapped"] if swap else at_failure["preempted"]
    sched = eng.scheduler
    # Back in the waiting queue: the running ones first, in order, then the waiting ones.
    assert not sched.running and [r.request_id for r in sched.waiting] == at_failure["queues"]
    assert all(r.num_computed_tokens == 0 and r.num_sent_tokens == 0 for r in sched.waiting)
    assert eng.kv.usage == 0.0 and (eng.kv.host is None or not eng.kv.host.swapped)
    after, steps = _run(eng)
    assert not _errors(steps) and not eng.has_unfinished()
    assert _tokens(done | after) == _tokens(expected)
    assert ex.restarts == 1 and eng.num_restarts == 1 and eng.healthy
    # The rebuilt workers got every resumed request in full, outputs included.
    resent = {nr.req_id: nr for so in ex.outputs for nr in so.new_reqs}
    assert any(nr.output_token_ids for nr in resent.values())
    kit.assert_idle(eng)


def test_the_failing_step_emits_nothing_and_streams_go_on(kit) -> None:
    ex = Flaky(fail_calls=(6,))
    eng = kit.make_engine(executor=ex, restarts=RestartPolicy(backoff_s=0.0))
    eng.add_request("a", prompt(1, 7), LONG)
    _, before = _run(eng, stop=lambda: ex.failures > 0)
    assert len(before) == 6 and before[-1] == []  # the failure: a pause, not an error
    seen = [t for step in before for d in step for t in d.completions[0].token_ids]
    (req,) = eng.scheduler.waiting
    assert req.output_token_ids == seen and req.num_failures == 1 and req.num_preemptions == 1
    done, after = _run(eng)
    tokens = seen + [t for step in after for d in step for t in d.completions[0].token_ids]
    assert tokens == done["a"].outputs[0].token_ids and len(tokens) == 12


def test_a_request_past_the_failure_limit_fails_alone(kit) -> None:
    ref = kit.make_engine()
    for i in range(2):
        ref.add_request(f"ok{i}", prompt(100 * i, 6), LONG)
    expected, _ = _run(ref)
    assert not ref.has_unfinished()
    # The poison request kills the group whenever it runs; its limit is 2 failures.
    ex = Flaky(poison="poison")
    eng = kit.make_engine(executor=ex, restarts=RestartPolicy(backoff_s=0.0, max_restarts=5))
    eng.add_request("poison", prompt(7, 5), LONG)
    for _ in range(2):
        assert eng.core.step() == []  # resumed each time
    assert ex.failures == 2 and eng.healthy
    for i in range(2):
        eng.add_request(f"ok{i}", prompt(100 * i, 6), LONG)
    (failed,) = eng.core.step()  # the third failure: the others ran through one
    assert failed.request_id == "poison" and failed.finished
    assert failed.error_code == RequestFailedError.__name__
    assert "rank 1 on node node-x" in failed.error and "max_failures_per_request=2" in failed.error
    assert [c.finish_reason for c in failed.completions] == ["error"]
    done, steps = _run(eng)
    assert not _errors(steps) and not eng.has_unfinished()
    assert _tokens(done) == _tokens(expected) and eng.healthy
    kit.assert_idle(eng)


@pytest.mark.parametrize("how", ["second failure", "rebuild fails"])
def test_past_the_restart_cap_every_request_ends_with_a_typed_error(kit, how: str) -> None:
    ex = Flaky(fail_calls=(4, 5), restart_failures=9 if how == "rebuild fails" else 0)
    eng = kit.make_engine(executor=ex, restarts=RestartPolicy(backoff_s=0.0, max_restarts=1),
                          num_host_blocks=64, preemption_mode="swap", **ENGINE)
    _workload(eng)
    ids = {f"r{i}" for i in range(4)} | {f"w{i}" for i in range(3)} | {"pair", "late-pair"}
    finals: dict[str, RequestDelta] = {}
    for _ in range(20):
        if not eng.healthy:
            break
        finals |= {d.request_id: d for d in eng.core.step() if d.finished}
    assert not eng.healthy and set(finals) == ids
    for d in finals.values():
        assert d.error_code == EngineDeadError.__name__ and "at most 1 restarts" in d.error
        assert "rank 1 on node node-x" in d.error
        assert all(c.finish_reason == "error" for c in d.completions)
    kit.assert_idle(eng)  # 0 blocks in either tier
    with pytest.raises(EngineDeadError):
        eng.core.step()


def test_through_the_loop_a_dead_engine_ends_streams_and_refuses_adds(kit) -> None:
    ex = Flaky(fail_calls=(3,))
    core = kit.make_engine(executor=ex, restarts=RestartPolicy(max_restarts=0)).core
    client = LocalEngineClient(EngineLoop(core), "fake")
    try:
        got: queue.SimpleQueue[RequestDelta] = queue.SimpleQueue()
        client.add_request(AddRequest("a", prompt(3, 6), LONG), got.put)
        while not (d := got.get(timeout=10)).finished:
            assert d.error is None
        assert d.error_code == EngineDeadError.__name__ and "node-x" in d.error
        # The loop tells its clients at once, not at the next add.
        assert not client.is_healthy()
        with pytest.raises(EngineDeadError):
            client.add_request(AddRequest("b", prompt(3, 6), LONG), got.put)
    finally:
        client.shutdown()
