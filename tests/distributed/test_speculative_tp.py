"""A draft model under tensor parallelism (two ranks on the shared local Ray instance): the
draft is sharded like the target, both ranks take the same draft passes, and greedy output is
transformers' greedy of the target, with drafts both accepted and rejected."""

from __future__ import annotations

import shutil
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
    SpeculativeConfig,
)
from pagedserve.controller.engine_core import EngineCore
from pagedserve.messages import SamplingParams

MAX_NEW = 24
PROMPTS = [[1, 17, 99, 4, 250, 31, 77, 17, 99, 4], [42, 7, 42, 7, 42], [5] * 30]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _perturbed_copy(src: Path, dst: Path, noise: float) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    noisy = {k: v + noise * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
    save_file(noisy, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_tp2_draft_model_matches_transformers(ray_local, tmp_path, request) -> None:
    target = make_checkpoint("llama", tmp_path / "target", init_std=0.05)
    draft = _perturbed_copy(target, tmp_path / "draft", 0.004)
    model = load_hf_model(target)
    expected = [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]
    config = EngineConfig(
        model=ModelConfig(model=str(target), dtype="float32"),
        cache=CacheConfig(block_size=4, kv_cache_memory_bytes=1 << 22),
        parallel=ParallelConfig(tensor_parallel_size=2),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
        speculative=SpeculativeConfig(method="draft_model", model=str(draft),
                                      num_speculative_tokens=3),
    )
    executor = ray_executor(config, ready_timeout_s=120, step_timeout_s=60)
    request.addfinalizer(executor.shutdown)
    engine = drive(EngineCore(config, executor, eos_token_ids=()))
    # Each rank holds half the draft's KV heads, as it does the target's.
    assert [s.num_kv_heads for s in engine.worker_report.draft_layer_specs] == [1, 1]
    assert generate(engine, PROMPTS, GREEDY) == expected
    stats = engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["kv_blocks_used"] == 0


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
