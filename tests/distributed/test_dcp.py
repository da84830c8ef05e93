"""Decode context parallelism through the Ray worker group: tp = 2 with dcp = 2 on a model
with one KV head (the two ranks would replicate it, so they shard tokens instead) must give the
tokens of tp = 1 and of transformers, for both interleave sizes, with prompts spanning several
virtual blocks and prefix caching on (the second round hits the cache).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.checkpoints import hf_greedy, load_hf_model, make_checkpoint
from helpers.driver import drive
from helpers.engine_run import generate
from helpers.ray_group import ray_executor

from pagedserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedserve.controller.engine_core import EngineCore
from pagedserve.messages import SamplingParams

BLOCK = 4
MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
SHARED = [1, 17, 99, 4, 250, 31, 77, 8, 9, 10, 11, 12, 13, 14, 15, 16, 18, 19]  # 18 tokens
# Virtual blocks hold BLOCK x 2 = 8 tokens: these span 3 to 5 of them, one an exact multiple.
PROMPTS = [SHARED + [5, 6], SHARED + [40, 41, 42, 43, 44, 45], SHARED[:16], [42, 43, 44]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("dcp") / "kv1", num_key_value_heads=1)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> list[list[int]]:
    model = load_hf_model(checkpoint)
    return [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]


@pytest.mark.parametrize("interleave", [1, BLOCK])
def test_dcp2_tp2_equals_transformers(
    ray_local, checkpoint: Path, reference: list[list[int]], interleave: int, request
) -> None:
    config = EngineConfig(
        model=ModelConfig(model=str(checkpoint), dtype="float32"),
        cache=CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=1 << 20),
        parallel=ParallelConfig(
            tensor_parallel_size=2, decode_context_parallel_size=2, dcp_interleave=interleave
        ),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
    )
    executor = ray_executor(config, ready_timeout_s=120, step_timeout_s=60)
    request.addfinalizer(executor.shutdown)
    engine = drive(EngineCore(config, executor, eos_token_ids=()))
    # The manager allocates virtual blocks of B x dcp tokens; capacity in tokens doubles.
    assert engine.kv.block_size == BLOCK * 2
    stats = engine.stats()
    assert stats["kv_capacity_tokens"] == stats["kv_blocks_total"] * BLOCK * 2

    assert generate(engine, PROMPTS, GREEDY, "a") == reference
    hits_before = engine.stats()["prefix_cache_hits"]
    # The same prompts again: served from the prefix cache.
    assert generate(engine, PROMPTS, GREEDY, "b") == reference
    assert engine.stats()["prefix_cache_hits"] > hits_before
