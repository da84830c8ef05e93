"""The host tier on a real worker: swapped requests resume with their KV intact, and a rank
that dies in the middle of a tier copy costs its requests nothing but a recompute: they resume
on the rebuilt worker (whose host tier starts empty) with the tokens they would have had."""

from __future__ import annotations

import pytest
from helpers.driver import drive

from pagedserve.builder import make_executor
from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.restarts import RestartPolicy
from pagedserve.kernels import swap_blocks
from pagedserve.messages import SamplingParams
from pagedserve.workers.kv_pool import KVPool, _pairs

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(18 + i)] for i in range(4)]


@pytest.fixture
def engine(checkpoint_dir):
    config = EngineConfig(
        model=ModelConfig(model=str(checkpoint_dir("llama")), dtype="float32"),
        # 15 usable blocks of 4 for four requests of ~8 blocks each: swap preemptions.
        cache=CacheConfig(block_size=4, num_gpu_blocks=16, num_host_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8,
                                  preemption_mode="swap"),
    )
    eng = drive(EngineCore(config, make_executor(config), eos_token_ids=(),
                           restarts=RestartPolicy(backoff_s=0.0)))
    yield eng
    eng.shutdown()


def _run(engine, tag: str) -> dict[str, object]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"{tag}{i}", p, GREEDY)
    done = {}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished()
    return done


def _assert_idle(engine) -> None:
    engine.kv.check_integrity()
    host = engine.kv.host
    assert engine.kv.num_free_blocks == engine.kv.pool.num_usable_blocks
    assert host.num_free_blocks == host.num_usable_blocks and not host.swapped


def test_a_rank_dying_mid_copy_resumes_its_requests_by_recompute(engine, monkeypatch):
    reference = {k[1:]: v.outputs[0].token_ids for k, v in _run(engine, "a").items()}
    assert engine.stats()["kv_host_swap_ins"] > 0
    _assert_idle(engine)

    copy = KVPool.copy_tiers
    armed = [True]

    def dies_mid_copy(self, to_host, to_device):
        if armed[0] and to_device:
            armed[0] = False
            copy(self, to_host, [])
            # The first layer's blocks arrive, then the rank goes down.
            swap_blocks(self.host_tensors[:1], self.tensors[:1], _pairs(to_device))
            raise RuntimeError("rank lost while copying KV blocks to the device")
        return copy(self, to_host, to_device)

    monkeypatch.setattr(KVPool, "copy_tiers", dies_mid_copy)
    resumed = _run(engine, "b")
    assert not armed[0] and engine.num_restarts == 1 and engine.healthy
    assert "while copying KV blocks" in str(engine.last_failure)
    assert all(o.error is None for o in resumed.values())
    assert {k[1:]: v.outputs[0].token_ids for k, v in resumed.items()} == reference
    _assert_idle(engine)
    # The rebuilt worker swaps as before.
    swap_ins = engine.stats()["kv_host_swap_ins"]
    again = _run(engine, "c")
    assert {k[1:]: v.outputs[0].token_ids for k, v in again.items()} == reference
    assert engine.stats()["kv_host_swap_ins"] > swap_ins
    _assert_idle(engine)
