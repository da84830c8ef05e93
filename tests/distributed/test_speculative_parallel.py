"""Speculative decoding through the Ray worker group: prompt lookup with tp = 2, and with tp = 2
and decode context parallelism (each rank holding every other token's KV), and a draft model
sharded like the target at tp = 2 (both ranks take the same draft passes): verified drafts give
exactly transformers' greedy tokens, drafts are both accepted and rejected, and blocks only
rejected drafts filled come back."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.checkpoints import hf_greedy, load_hf_model, make_checkpoint, perturbed_copy
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

BLOCK = 4
MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
HEAD = [17, 99, 4, 250, 31, 77, 8, 9, 10, 11]
PROMPTS = [HEAD + HEAD[:5], [42, 43, 44], HEAD[:7] + [5, 6] + HEAD[:7]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # One KV head, so that dcp = 2 shards tokens; a small init makes the model repeat phrases
    # of its own, which prompt lookup sometimes predicts.
    return make_checkpoint("llama", tmp_path_factory.mktemp("spec") / "kv1",
                           num_key_value_heads=1, init_std=0.05)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> list[list[int]]:
    model = load_hf_model(checkpoint)
    return [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]


def _run(config: EngineConfig, request) -> tuple[EngineCore, list[list[int]]]:  # noqa: ANN001
    executor = ray_executor(config, ready_timeout_s=120, step_timeout_s=60)
    request.addfinalizer(executor.shutdown)
    engine = drive(EngineCore(config, executor, eos_token_ids=()))
    tokens = generate(engine, PROMPTS, GREEDY, "a")
    stats = engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["kv_blocks_used"] == 0
    return engine, tokens


def _config(model: Path, dcp: int, spec: SpeculativeConfig) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model), dtype="float32"),
        cache=CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=1 << 20),
        parallel=ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=dcp),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
        speculative=spec,
    )


@pytest.mark.parametrize("dcp", [1, 2])
def test_tp2_verifies_prompt_lookup_drafts_exactly(
    ray_local, checkpoint: Path, reference: list[list[int]], dcp: int, request
) -> None:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    _, tokens = _run(_config(checkpoint, dcp, spec), request)
    assert tokens == reference


def test_tp2_draft_model_matches_transformers(ray_local, tmp_path: Path, request) -> None:
    # Two KV heads: each rank holds one of the target's and one of the draft's.
    target = make_checkpoint("llama", tmp_path / "target", init_std=0.05)
    draft = perturbed_copy(target, tmp_path / "draft", 0.004)
    model = load_hf_model(target)
    spec = SpeculativeConfig(method="draft_model", model=str(draft), num_speculative_tokens=3)
    engine, tokens = _run(_config(target, 1, spec), request)
    assert tokens == [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]
    # Each rank holds half the draft's KV heads, as it does the target's.
    assert [s.num_kv_heads for s in engine.worker_report.draft_layer_specs] == [1, 1]
