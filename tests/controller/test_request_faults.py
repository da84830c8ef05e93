"""A request the workers reject fails alone: its group ends with a typed error, every other
request's tokens are those it makes without it, the restart budget is untouched, and no block
it left unwritten stays in the prefix cache (a request that read one in the same step is
computed again)."""

from __future__ import annotations

import pytest

from pagedserve.controller.errors import RequestFailedError
from pagedserve.messages import NewRequestData, SamplingParams

BAD_SEED = 13  # the marker of the request the fake worker cannot take


def _reject(nr: NewRequestData) -> str | None:
    return "OverflowError: top_k does not fit" if nr.sampling_params.seed == BAD_SEED else None


def _good(kit, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[int]]:
    """Each good request's tokens from an engine that never saw the bad one."""
    engine = kit.make_engine()
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    return {rid: out.outputs[0].token_ids for rid, out in kit.run(engine).items()}


def _assert_failed_alone(out, n: int = 1) -> None:
    assert out.finished and out.error_code == RequestFailedError.__name__
    assert "top_k does not fit" in out.error
    assert [c.finish_reason for c in out.outputs] == ["error"] * n
    assert all(c.token_ids == [] for c in out.outputs)


@pytest.mark.parametrize("n", [1, 3])
def test_a_rejected_request_fails_alone(kit, n: int) -> None:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = {f"g{i}": [5 + i] * (3 + 5 * i) for i in range(4)}
    fake = kit.FakeExecutor(reject=_reject)
    engine = kit.make_engine(executor=fake)
    for i, (rid, prompt) in enumerate(prompts.items()):
        engine.add_request(rid, prompt, params)
        if i == 1:  # in the middle of the batch
            engine.add_request("bad", [9] * 10, SamplingParams(n=n, seed=BAD_SEED, max_tokens=12))
    done = kit.run(engine)
    _assert_failed_alone(done.pop("bad"), n)
    assert {rid: out.outputs[0].token_ids for rid, out in done.items()} == _good(
        kit, prompts, params
    )
    assert all(out.error is None for out in done.values())
    assert engine.healthy and engine.num_restarts == 0 and fake.restarts == 0
    assert engine.restarts.recent_failures == 0
    assert fake.bad_reads == []
    kit.assert_idle(engine)


def test_rejections_never_spend_the_restart_budget(kit) -> None:
    fake = kit.FakeExecutor(reject=_reject)
    engine = kit.make_engine(executor=fake)
    limit = engine.restarts.max_restarts
    for round_ in range(limit + 3):
        engine.add_request(f"bad{round_}", [3, 4, 5], SamplingParams(seed=BAD_SEED))
        engine.add_request(f"ok{round_}", [3, 4, 6], SamplingParams(max_tokens=2))
        done = kit.run(engine)
        _assert_failed_alone(done[f"bad{round_}"])
        ok = done[f"ok{round_}"]
        assert ok.error is None and len(ok.outputs[0].token_ids) == 2
    assert engine.healthy and engine.num_restarts == 0 and fake.restarts == 0
    kit.assert_idle(engine)


def test_a_same_step_prefix_hit_on_a_rejected_request_is_recomputed(kit) -> None:
    """``reader`` is admitted right after ``bad`` in one step and hits the blocks ``bad`` was to
    write: it reads nothing of its own there, so its step is void and it runs again; those
    blocks leave the prefix cache, so no later request hits them either."""
    shared = list(range(10, 22))  # three full blocks of 4
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    fake = kit.FakeExecutor(reject=_reject)
    engine = kit.make_engine(executor=fake)
    engine.add_request("bad", [*shared, 1], SamplingParams(seed=BAD_SEED, max_tokens=6))
    engine.add_request("reader", [*shared, 2, 3], params)
    first = {o.request_id: o for o in engine.step()}
    assert first["bad"].error_code == RequestFailedError.__name__
    assert fake.bad_reads and {rid for rid, _ in fake.bad_reads} == {"reader"}
    assert engine.scheduler.num_preemptions == 1
    # A request arriving later finds none of bad's unwritten blocks in the cache.
    engine.add_request("later", [*shared, 4], params)
    done = kit.run(engine)
    assert {rid for rid, _ in fake.bad_reads} == {"reader"}  # only that first, voided step
    expected = _good(kit, {"reader": [*shared, 2, 3], "later": [*shared, 4]}, params)
    assert {rid: done[rid].outputs[0].token_ids for rid in expected} == expected
    assert engine.healthy and engine.num_restarts == 0
    kit.assert_idle(engine)
