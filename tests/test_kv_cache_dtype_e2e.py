"""A KV cache of its own dtype under a float32 model, through the worker and ``LLM``.

Block counts: in the same ``kv_cache_memory_bytes`` a bfloat16 KV cache holds exactly 2x and an
fp8 one 4x the blocks of the float32 model's own, and the pool allocates no more bytes.

Generation (tiny random Llama, init std 0.2, 3 prompts x 24 greedy tokens): the float32-KV run's
tokens are scored again, teacher-forced (prompt logprobs), with a bfloat16 and an fp8 KV cache.
The logprob of each float32 top-1 token stays within ``TOL`` of the float32-KV one (max over
positions, and mean). Measured here (AVX2): bf16 max 0.029, mean 0.006; fp8 max 0.48, mean 0.12
at scale 1.0, max 0.41, mean 0.13 with scales calibrated on the first prefill (e4m3 keeps 4
significant bits; this checkpoint's large random weights make every rounding count).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import make_checkpoint

from pagedserve import LLM, SamplingParams
from pagedserve.config import ConfigError, from_flat
from pagedserve.controller.kv_plan import plan_kv_cache
from pagedserve.workers.worker import Worker

BUDGET = 1 << 20  # 128 float32 blocks of 16 tokens for 2 layers x 2 KV heads x 16 dims
NEW_TOKENS = 24
# (kv_cache_dtype, calculate_kv_scales) -> (max, mean) |logprob - float32-KV logprob|
TOL = {
    ("bfloat16", False): (0.1, 0.02),
    ("fp8_e4m3", False): (1.0, 0.25),
    ("fp8_e4m3", True): (1.0, 0.25),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("kvdtype") / "tiny-llama")


def test_block_count_follows_the_kv_dtype(ckpt: Path) -> None:
    blocks, pools = {}, {}
    for kv in ("auto", "bfloat16", "fp8_e4m3"):
        config = from_flat(model=str(ckpt), kv_cache_memory_bytes=BUDGET, kv_cache_dtype=kv)
        worker = Worker(config)
        report = worker.load_model()
        layout = plan_kv_cache(config, report, 64).layout
        blocks[kv] = layout.num_blocks
        worker.init_kv_cache(layout)
        pool = worker.runner.kv_pool
        pools[kv] = (pool.num_bytes, {t.dtype for t in pool.tensors})
        worker.shutdown()
    assert blocks["auto"] == 128
    assert blocks["bfloat16"] == 2 * blocks["auto"] and blocks["fp8_e4m3"] == 4 * blocks["auto"]
    assert pools["auto"] == (BUDGET, {torch.float32})
    assert pools["bfloat16"] == (BUDGET, {torch.bfloat16})
    assert pools["fp8_e4m3"] == (BUDGET, {torch.float8_e4m3fn})


def test_unknown_kv_cache_dtype_is_refused_by_name(ckpt: Path) -> None:
    with pytest.raises(ConfigError) as info:
        LLM(str(ckpt), backend="local", kv_cache_dtype="int4")
    assert info.value.field == "kv_cache_dtype" and "fp8_e4m3" in str(info.value)


def _engine(ckpt: Path, **kw) -> LLM:
    return LLM(str(ckpt), backend="local", kv_cache_memory_bytes=BUDGET, **kw)


def _top1_logprobs(llm: LLM, seqs: list[list[int]], starts: list[int]) -> list[float]:
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    got = []
    for seq, start in zip(seqs, starts, strict=True):
        lp = llm.generate([seq], score, use_tqdm=False)[0].prompt_logprobs
        got += [lp[i][seq[i]] for i in range(start, len(seq))]
    return got


@pytest.fixture(scope="module")
def float32_run(ckpt: Path):
    """(sequences: prompt + float32-KV greedy tokens, prompt lengths, their top-1 logprobs,
    the engine's stats)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 40)]
    llm = _engine(ckpt)
    try:
        greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
        starts = [len(p) for p in prompts]
        return seqs, starts, _top1_logprobs(llm, seqs, starts), llm.stats()
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("kv", "calibrate"), list(TOL))
def test_teacher_forced_logprobs_within_tolerance(ckpt: Path, float32_run, caplog, kv: str,
                                                  calibrate: bool) -> None:
    seqs, starts, want, base_stats = float32_run
    with caplog.at_level(logging.INFO, logger="pagedserve.workers.kv_dtype"):
        llm = _engine(ckpt, kv_cache_dtype=kv, calculate_kv_scales=calibrate)
    try:
        assert "the compiled CPU kernels quantize on write and widen on read" in caplog.text
        got = _top1_logprobs(llm, seqs, starts)
        stats = llm.stats()
        scales = llm.engine.executor.collective_rpc("kv_scales")[0]
    finally:
        llm.shutdown()
    diffs = [abs(a - b) for a, b in zip(got, want, strict=True)]
    max_tol, mean_tol = TOL[(kv, calibrate)]
    assert max(diffs) <= max_tol and sum(diffs) / len(diffs) <= mean_tol, (max(diffs), diffs)
    ratio = 4 if kv == "fp8_e4m3" else 2
    assert stats["kv_blocks_total"] + 1 == ratio * (base_stats["kv_blocks_total"] + 1)
    assert stats["kv_cache_bytes"] == base_stats["kv_cache_bytes"] == BUDGET
    assert stats["kv_cache_element_bytes"] * ratio == base_stats["kv_cache_element_bytes"] == 4
    if calibrate:  # from the first prefill's amax: positive, finite, not the default
        assert all(0 < s < float("inf") and s != 1.0 for pair in scales for s in pair)
    else:
        assert scales == [(1.0, 1.0)] * len(scales)
