"""Prompt logprobs against transformers: ``log_softmax`` of its float32 logits over the prompt.

Through ``LLM.generate`` (prefix caching with a warm prefix, chunked prefill, ``n=2``,
preemption, ``max_tokens=0``), the OpenAI server (``echo`` with ``logprobs``) and the JSONL job.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from helpers.checkpoints import load_hf_model, make_checkpoint

from pagedserve import LLM, SamplingParams

TOL = 1e-4
TOP = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("plp") / "tiny-llama")


@pytest.fixture(scope="module")
def reference(ckpt: Path):
    """prompt -> the transformers log-softmax over the vocabulary at every position."""
    import torch

    model = load_hf_model(ckpt)
    cache: dict[tuple[int, ...], Any] = {}

    def logprobs(prompt: list[int]):
        key = tuple(prompt)
        if key not in cache:
            with torch.no_grad():
                logits = model(torch.tensor([prompt])).logits[0].float()
            cache[key] = logits.log_softmax(-1)
        return cache[key]

    return logprobs


def _prompts(seed: int, lens: tuple[int, ...], prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(3, 512) for _ in range(n)] for n in lens]


def check_prompt_logprobs(reference, prompt: list[int], got, top: int = TOP) -> float:
    """Every position present, the prompt token first, the top ``top`` exact; returns the
    largest absolute difference against transformers."""
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    lp = reference(prompt)
    worst = 0.0
    for p in range(1, len(prompt)):
        entry = got[p]
        assert next(iter(entry)) == prompt[p]
        want = {prompt[p]: lp[p - 1, prompt[p]].item()}
        values, ids = lp[p - 1].topk(top)
        want.update(zip(ids.tolist(), values.tolist(), strict=True))
        assert set(entry) == set(want), p
        worst = max(worst, *(abs(entry[t] - v) for t, v in want.items()))
    assert worst < TOL, worst
    return worst


def test_generate_prefix_cache_chunked_and_n2(ckpt: Path, reference) -> None:
    shared = _prompts(1, (40,))[0]
    prompts = [shared, *_prompts(2, (5, 23), prefix=shared), *_prompts(3, (1, 17))]
    llm = LLM(str(ckpt), backend="local", enable_prefix_caching=True, block_size=16,
              max_num_batched_tokens=16)
    try:
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        warm = llm.generate(prompts, greedy, use_tqdm=False)
        assert all(o.prompt_logprobs is None for o in warm)
        hits_before = llm.stats()["prefix_cache_hits"]
        assert hits_before > 0  # the prompts sharing ``shared`` hit its blocks
        scored = llm.generate(
            prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                    prompt_logprobs=TOP), use_tqdm=False,
        )
        for p, out, w in zip(prompts, scored, warm, strict=True):
            check_prompt_logprobs(reference, p, out.prompt_logprobs)
            assert out.num_cached_tokens == 0
            assert out.outputs[0].token_ids == w.outputs[0].token_ids
        (pair,) = llm.generate(
            [prompts[2]], SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=3,
                                         prompt_logprobs=TOP), use_tqdm=False,
        )
        check_prompt_logprobs(reference, prompts[2], pair.prompt_logprobs)
        assert len(pair.outputs) == 2 and all(len(c.token_ids) == 3 for c in pair.outputs)
        # max_tokens=0: the prompt alone, scored.
        (alone,) = llm.generate([prompts[1]], SamplingParams(max_tokens=0, prompt_logprobs=0),
                                use_tqdm=False)
        check_prompt_logprobs(reference, prompts[1], alone.prompt_logprobs, top=0)
        assert alone.outputs[0].token_ids == [] and alone.outputs[0].finish_reason == "length"
    finally:
        llm.shutdown()


def test_generate_under_preemption(ckpt: Path, reference, monkeypatch) -> None:
    from pagedserve.workers import model_runner

    # Score a chunk's prompt positions a few rows at a time, as a large vocabulary would.
    monkeypatch.setattr(model_runner, "PROMPT_LOGITS_BYTES", 7 * 4 * 512)
    prompts = _prompts(4, (45, 64, 33, 50))
    llm = LLM(str(ckpt), backend="local", num_gpu_blocks=14, block_size=16,
              max_num_batched_tokens=32)
    try:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                prompt_logprobs=TOP)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats()["num_preemptions"] > 0
    finally:
        llm.shutdown()
    for p, out in zip(prompts, outs, strict=True):
        check_prompt_logprobs(reference, p, out.prompt_logprobs)


def test_jsonl_job_carries_prompt_logprobs(ckpt: Path, reference, tmp_path: Path) -> None:
    from pagedserve.builder import start_engine
    from pagedserve.config import from_flat
    from pagedserve.serving.jsonl_job.job import run_job

    prompts = _prompts(5, (12, 30))
    inp = tmp_path / "in.jsonl"
    lines = [
        {"id": "scored", "prompt_token_ids": prompts[0], "prompt_logprobs": TOP},
        {"id": "plain", "prompt_token_ids": prompts[1]},
        {"id": "bad", "prompt_token_ids": prompts[1], "prompt_logprobs": 99},
        {"id": "alone", "prompt_token_ids": prompts[1], "prompt_logprobs": 0, "max_tokens": 0},
    ]
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    client = start_engine(from_flat(model=str(ckpt), max_model_len=128), backend="local")
    try:
        summary = run_job(client, str(inp), str(out), {"max_tokens": 3, "temperature": 0.0},
                          progress="none")
    finally:
        client.shutdown()
    assert summary.succeeded == 3 and summary.failed == 1
    recs = {r["id"]: r for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    assert "prompt_logprobs" in recs["bad"]["error"]
    assert "prompt_logprobs" not in recs["plain"]
    for rid, p, top in (("scored", prompts[0], TOP), ("alone", prompts[1], 0)):
        rows = recs[rid]["prompt_logprobs"]
        assert rows[0] is None
        # Back to the engine's shape: the prompt token first, then the top alternatives.
        got = [None] + [
            {r["token_id"]: r["logprob"], **{t: v for t, v in r["top_logprobs"]}}
            for r in rows[1:]
        ]
        assert all(len(r["top_logprobs"]) == top for r in rows[1:])
        check_prompt_logprobs(reference, p, got, top=top)
    assert recs["alone"]["token_ids"] == [] and recs["alone"]["usage"]["completion_tokens"] == 0
