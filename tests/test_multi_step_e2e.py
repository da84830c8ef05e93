"""Several decode passes per step (``num_scheduler_steps``) end to end on real models: greedy
tokens equal transformers', and sampled ones (seeds, penalties, ``min_tokens``, stop tokens,
logprobs) equal what one pass per step samples.

Each case asserts that steps ran several passes, so none passes without them.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers.checkpoints import hf_greedy, load_hf_model, repeating_prompts

from pagedserve import LLM, SamplingParams


def _run(path: Path, prompts, params, **options):
    llm = LLM(str(path), backend="local", **options)
    try:
        return llm.generate(prompts, params, use_tqdm=False), llm.stats()
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("kind", "block_size", "num_prompts"),
                         [("llama", 4, 1), ("hybrid", 4, 3), ("qwen3", 16, 2)])
def test_greedy_equals_transformers(checkpoint_dir, kind: str, block_size: int,
                                    num_prompts: int) -> None:
    """Passes run into lookahead slots across block boundaries (block size 4), over a sliding
    window's group too (hybrid), and stop at ``max_tokens`` (30 = 3 x 8 + 6)."""
    path = checkpoint_dir(kind)
    prompts = repeating_prompts(3, (5, 12, 21))[:num_prompts]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    outs, stats = _run(path, prompts, params, block_size=block_size, num_scheduler_steps=8)
    model = load_hf_model(path)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, p, 30)
        assert out.outputs[0].finish_reason == "length"
    # Every step after the prefill ran 8 passes: ceil(29 / 8) of them.
    assert stats["num_multi_pass_steps"] == math.ceil(29 / 8)
    assert stats["kv_blocks_used"] == 0


def test_sampling_equals_one_pass_per_step(checkpoint_dir) -> None:
    """Seeded sampling with penalties, ``min_tokens`` before a stop token, logprobs and a
    length cap (``max_model_len``) mid-way through a step's passes: the same tokens, logprobs
    and finish reasons as one pass per step."""
    path = checkpoint_dir("llama")
    prompts = repeating_prompts(5, (4, 9, 15, 6))
    opts = {"block_size": 4, "max_model_len": 45}
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    seen = _run(path, prompts[2:3], greedy, **opts)[0][0].outputs[0].token_ids
    # A token greedy decoding reaches first as its 10th or later: then the stop ends it there.
    at = next(i for i in range(9, 20) if seen[i] not in seen[:i])
    params = [
        SamplingParams(max_tokens=27, temperature=0.9, seed=7, repetition_penalty=1.3,
                       presence_penalty=0.4, frequency_penalty=0.2, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=19, temperature=0.8, top_k=20, seed=11, logprobs=0,
                       ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, min_tokens=8,
                       stop_token_ids=[seen[at]], ignore_eos=True),
        SamplingParams(max_tokens=None, temperature=1.0, seed=3, ignore_eos=True),
    ]
    one, _ = _run(path, prompts, params, num_scheduler_steps=1, **opts)
    many, stats = _run(path, prompts, params, num_scheduler_steps=8, **opts)
    assert stats["num_multi_pass_steps"] > 0
    for a, b in zip(one, many, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert cb.token_ids == ca.token_ids
        assert (cb.finish_reason, cb.stop_reason) == (ca.finish_reason, ca.stop_reason)
        assert (ca.logprobs is None) == (cb.logprobs is None)
        for la, lb in zip(ca.logprobs or [], cb.logprobs or [], strict=True):
            assert la.keys() == lb.keys()
            assert all(math.isclose(la[t], lb[t], abs_tol=1e-5) for t in la)
    assert [o.outputs[0].finish_reason for o in many] == ["length", "length", "stop", "length"]
    assert len(many[3].outputs[0].token_ids) == 45 - len(prompts[3])  # max_model_len
    assert many[2].outputs[0].token_ids == seen[: at + 1]
