"""``EngineCore``'s worker-group fault handling without Ray: an in-process fake executor that
fails on demand stands in for a worker group whose rank died. The requests in flight resume on
the rebuilt group; only past the restart cap do they fail."""

from __future__ import annotations

import time

import pytest
from helpers.checkpoints import make_checkpoint
from helpers.driver import drive
from helpers.fake_executor import FakeExecutor

from pagedserve.builder import make_executor
from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.errors import EngineDeadError
from pagedserve.controller.executor import LocalExecutor, WorkerGroupError
from pagedserve.controller.restarts import RestartPolicy
from pagedserve.messages import SamplingParams

PROMPT = list(range(3, 40))  # several full blocks of 4: prefix-cacheable
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def flaky(**kw) -> FakeExecutor:
    """A fake worker group whose next step fails on request (``fail``), and whose restarts may
    fail (``restart_failures``); its vocabulary is the test checkpoint's tokenizer's."""
    return FakeExecutor(vocab_size=512, **kw)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    path = make_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama")
    return EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32"),
        cache=CacheConfig(block_size=4, num_gpu_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
    )


def _finish(engine: EngineCore, ids: set[str]) -> dict:
    done = {}
    for _ in range(100):
        done |= {o.request_id: o for o in engine.step() if o.finished}
        if ids <= done.keys():
            return done
    raise AssertionError(f"requests did not finish: {ids - done.keys()}")


def _run(engine: EngineCore, rid: str):
    engine.add_request(rid, PROMPT, GREEDY)
    for _ in range(100):
        for out in engine.step():
            if out.finished:
                return out
    raise AssertionError("request did not finish")


def test_failure_resumes_requests_in_a_fresh_cache_and_recovers(config):
    ex = flaky()
    engine = drive(EngineCore(config, ex, eos_token_ids=(), restarts=RestartPolicy(backoff_s=0.01)))
    try:
        reference = _run(engine, "a").outputs[0].token_ids
        assert _run(engine, "b").num_cached_tokens > 0  # the prefix cache is warm
        pair = SamplingParams(max_tokens=8, n=2, ignore_eos=True)
        engine.add_request("p", [5, 6, 7], pair)
        pair_ref = [c.token_ids for c in _finish(engine, {"p"})["p"].outputs]
        engine.add_request("c", PROMPT, GREEDY)
        engine.add_request("d", [5, 6, 7], pair)
        engine.step()
        old_kv = engine.kv
        ex.fail = WorkerGroupError(1, "node-x", "the worker actor died")
        assert engine.step() == []  # no error: the requests wait for the rebuilt group
        assert engine.kv is not old_kv and engine.kv.usage == 0.0
        assert {r.request_id for r in engine.scheduler.waiting} == {"c", "d#0", "d#1"}
        done = _finish(engine, {"c", "d"})
        assert ex.restarts == 1 and engine.num_restarts == 1 and engine.healthy
        assert done["c"].error is None and done["c"].outputs[0].token_ids == reference
        assert [c.token_ids for c in done["d"].outputs] == pair_ref
        assert engine.stats()["kv_blocks_used"] == 0
    finally:
        engine.shutdown()


def test_restarts_back_off_exponentially_then_the_engine_dies(config):
    ex = flaky(restart_failures=10)
    policy = RestartPolicy(max_restarts=2, backoff_s=0.1)
    engine = drive(EngineCore(config, ex, eos_token_ids=(), restarts=policy))
    try:
        engine.add_request("a", PROMPT, GREEDY)
        ex.fail = WorkerGroupError(1, "node-x", "the worker actor died")
        failed_at = time.monotonic()
        assert engine.step() == []  # "a" waits for the rebuild
        assert engine.step() == []  # restart 1 fails (after 0.1 s)
        assert engine.healthy
        (out,) = engine.step()  # restart 2 fails (after 0.2 s more): 3 failures > 2
        assert not engine.healthy and out.request_id == "a" and out.finished
        assert out.error_code == EngineDeadError.__name__ and "at most 2 restarts" in out.error
        assert "rank 1 on node node-x" in out.error
        assert engine.stats()["kv_blocks_used"] == 0
        gaps = [ex.restart_times[0] - failed_at, ex.restart_times[1] - ex.restart_times[0]]
        assert gaps[0] >= 0.09 and gaps[1] >= 0.19, gaps
        with pytest.raises(EngineDeadError):
            engine.step()
    finally:
        engine.shutdown()


def test_a_policy_without_restarts_makes_the_engine_dead_at_the_first_failure(config):
    class Broken(LocalExecutor):
        def execute(self, scheduler_output):
            raise WorkerGroupError(0, "node-y", "gone")

    inner = make_executor(config)
    engine = drive(EngineCore(config, Broken(inner._make_worker), eos_token_ids=(),
                              restarts=RestartPolicy(max_restarts=0)))
    engine.add_request("a", PROMPT, GREEDY)
    (out,) = engine.step()
    assert out.error and "node-y" in out.error and out.error_code == EngineDeadError.__name__
    assert not engine.healthy
    with pytest.raises(EngineDeadError, match="at most 0 restarts"):
        engine.step()
