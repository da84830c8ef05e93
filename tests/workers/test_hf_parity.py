"""Greedy tokens of our Worker equal transformers' ``generate`` token for token (float32)."""

from __future__ import annotations

import random

import pytest

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.workers.worker import Worker

BLOCK = 4


def make_worker(path, **model_kw) -> Worker:
    cfg = EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32", **model_kw),
        cache=CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=1 << 24),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
    )
    return Worker(cfg)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(3, 21))] for _ in range(n)]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "hybrid"])
def test_greedy_matches_transformers(kind, checkpoint_dir, checkpoints, stepper_module):
    path = checkpoint_dir(kind)
    worker = make_worker(path)
    report = worker.load_model()
    layout = stepper_module.layout_for(report, num_blocks=96, block_size=BLOCK)
    if kind == "hybrid":
        assert len(layout.groups) == 2
        assert [s.sliding_window for s in report.layer_specs] == [8, None, 8, None]
    worker.init_kv_cache(layout)
    st = stepper_module.Stepper(worker, layout, seed=1)
    ps = prompts(4)
    new_tokens = 12
    for i, p in enumerate(ps):
        st.add(f"r{i}", p, new_tokens)
    # A budget below the longest prompt splits prefills over steps (chunked prefill).
    ours = st.run(budget=24)
    hf = checkpoints.load_hf_model(path)
    for i, p in enumerate(ps):
        assert ours[f"r{i}"] == checkpoints.hf_greedy(hf, p, new_tokens), f"request r{i}"
    worker.shutdown()
