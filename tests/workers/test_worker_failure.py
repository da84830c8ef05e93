"""A worker failure in the middle of decoding, on a real worker: the rebuilt worker gets every
request in full and each one continues its sequence exactly, seeded sampling included (its
noise is a function of seed and position, so nothing random is lost with the worker)."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.driver import drive

from pagedserve.builder import make_executor
from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.executor import LocalExecutor, WorkerGroupError
from pagedserve.controller.restarts import RestartPolicy
from pagedserve.messages import SamplingParams

SEEDED = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
REQUESTS = {
    "seeded": ([1, 17, 99, 4, 250, 31, 77, 8, 300, 41], SEEDED),
    "pair": ([5, 6, 7, 8, 9], SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7,
                                             n=2, ignore_eos=True)),
    "greedy": ([42, 43, 44], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
}


class DiesOnce(LocalExecutor):
    """The worker's rank dies at the ``fail_call``-th step (0: never)."""

    def __init__(self, make_worker, fail_call: int) -> None:
        super().__init__(make_worker)
        self.fail_call = fail_call
        self.calls = 0

    def execute(self, scheduler_output):
        self.calls += 1
        if self.calls == self.fail_call:
            raise WorkerGroupError(0, "node-w", "the worker process died")
        return super().execute(scheduler_output)


@pytest.fixture(scope="module")
def config(checkpoint_dir) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(checkpoint_dir("llama")), dtype="float32"),
        cache=CacheConfig(block_size=4, num_gpu_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
    )


def _run(config: EngineConfig, fail_call: int) -> dict[str, list[list[int]]]:
    executor = DiesOnce(make_executor(config)._make_worker, fail_call)
    engine = drive(EngineCore(config, executor, eos_token_ids=(),
                              restarts=RestartPolicy(backoff_s=0.0)))
    try:
        for rid, (prompt, params) in REQUESTS.items():
            engine.add_request(rid, prompt, params)
        done = {}
        for _ in range(200):
            if not engine.has_unfinished():
                break
            for out in engine.step():
                assert out.error is None
                if out.finished:
                    done[out.request_id] = [c.token_ids for c in out.outputs]
        assert engine.num_restarts == (1 if fail_call else 0)
        return done
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("passes", "fail_call"), [(1, 2), (1, 6), (8, 2), (8, 3)])
def test_seeded_and_greedy_sequences_continue_exactly_after_a_failure(config, passes, fail_call):
    """One decode pass per step, or eight: the four sequences then finish in a few steps, so
    the failure comes at the third, after a step of several passes."""
    config = dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, num_scheduler_steps=passes))
    uninterrupted = _run(config, 0)
    assert len(set(uninterrupted["seeded"][0])) > 2  # it really samples
    assert _run(config, fail_call) == uninterrupted
