"""Speculative decoding end to end: drafts from prompt lookup or suffix trees, verified by the
workers, never change a greedy token (transformers is the reference), and the machinery they
stress (rejected slots given back, prefix hits, preemption, several completions) stays exact.

Each case asserts that drafts were both accepted and rejected, so none passes without
speculating.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from helpers.checkpoints import hf_greedy, load_hf_model, make_checkpoint, repeating_prompts

from pagedserve import LLM, SamplingParams

MAX_NEW = 40
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@functools.cache
def _checkpoint(kind: str, root: str) -> Path:
    # A smaller initialisation than the other tests' makes these models loop over phrases
    # of their own, which drafts sometimes predict and sometimes do not.
    return make_checkpoint(kind, Path(root) / kind, init_std=0.05)


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ckpts"))


@functools.cache
def _reference(path: str, prompts: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    model = load_hf_model(path)
    return [hf_greedy(model, list(p), MAX_NEW) for p in prompts]


def _run(path: Path, prompts: list[list[int]], params=GREEDY, **options):
    llm = LLM(str(path), backend="local", **options)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return outs, llm.stats()
    finally:
        llm.shutdown()


def _assert_speculated(stats: dict) -> None:
    """Drafts were proposed, some accepted and some rejected, and every block came back."""
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens_pos_0"] >= stats.get(
        "spec_decode_num_accepted_tokens_pos_1", 0)
    assert stats["kv_blocks_used"] == 0


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(("method", "k", "block_size"), [
    ("ngram", 1, 16), ("ngram", 3, 4), ("ngram", 5, 16), ("suffix", 4, 8), ("suffix", 8, 16),
])
def test_greedy_equals_transformers(method: str, k: int, block_size: int, ckpt_root: str) -> None:
    path = _checkpoint("llama", ckpt_root)
    prompts = repeating_prompts(1)
    spec = {"method": method, "num_speculative_tokens": k}
    outs, stats = _run(path, prompts, block_size=block_size, speculative_config=spec)
    assert _tokens(outs) == _reference(str(path), tuple(map(tuple, prompts)))
    _assert_speculated(stats)


def test_preemption_and_prefix_hits(ckpt_root: str) -> None:
    path = _checkpoint("hybrid", ckpt_root)  # sliding-window and full-attention groups
    shared = repeating_prompts(7, (40,))[0]
    prompts = [shared + p for p in repeating_prompts(2, (3, 9, 20))]
    prompts += repeating_prompts(3, (50, 64))
    # Five requests of up to ~180 tokens in 20 blocks of 16: preemptions, with drafts pending.
    outs, stats = _run(path, prompts, num_gpu_blocks=20, block_size=16,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert _tokens(outs) == _reference(str(path), tuple(map(tuple, prompts)))
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    _assert_speculated(stats)


def test_stop_inside_an_accepted_run_ends_there(ckpt_root: str) -> None:
    path = _checkpoint("llama", ckpt_root)
    prompt = repeating_prompts(1)[2]
    full = _reference(str(path), (tuple(prompt),))[0]
    spec = {"method": "ngram", "num_speculative_tokens": 5}
    for cut in (7, 20, 33):
        stop = full[cut]
        first = full.index(stop)
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[stop])
        outs, _ = _run(path, [prompt], params, speculative_config=spec)
        assert outs[0].outputs[0].token_ids == full[: first + 1]
        assert outs[0].outputs[0].finish_reason == "stop"
    # max_tokens inside a run: exactly that many tokens.
    outs, _ = _run(path, [prompt], SamplingParams(max_tokens=13, temperature=0.0,
                                                  ignore_eos=True), speculative_config=spec)
    assert outs[0].outputs[0].token_ids == full[:13]


def test_backs_off_at_batch_size(ckpt_root: str) -> None:
    path = _checkpoint("llama", ckpt_root)
    prompts = repeating_prompts(1)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 1}
    outs, stats = _run(path, prompts, speculative_config=spec)
    assert _tokens(outs) == _reference(str(path), tuple(map(tuple, prompts)))
    assert stats["spec_decode_num_draft_tokens"] == 0


def test_unknown_speculative_option_is_refused_by_name(ckpt_root: str) -> None:
    from pagedserve.config import ConfigError

    path = _checkpoint("llama", ckpt_root)
    with pytest.raises(ConfigError, match="speculative_config.num_spec_tokens"):
        LLM(str(path), backend="local",
            speculative_config={"method": "ngram", "num_spec_tokens": 3})
    with pytest.raises(ConfigError, match="speculative_config.method"):
        LLM(str(path), backend="local", speculative_config={"method": "eagle"})


class _Guesser:
    """A proposer for the sampling test: one draft, drawn from a few likely and unlikely
    tokens by request id, so the model's own sample sometimes equals it and sometimes not."""

    def __init__(self, candidates: list[int]) -> None:
        self.candidates = candidates

    def propose(self, request_id, token_ids, num_prompt_tokens, max_drafts):  # noqa: ANN001
        return [self.candidates[hash(request_id) % len(self.candidates)]]

    def release(self, request_id) -> None:  # noqa: ANN001
        pass


def _target(path: Path, prompt: list[int], top_k: int) -> tuple[dict, dict]:
    """The exact first-token and second-token (marginal) distributions at temperature 1 with
    top-k, from transformers in float64."""
    import torch

    model = load_hf_model(str(path)).double()

    def dist(ids: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        top = torch.topk(logits, top_k)
        probs = torch.softmax(top.values, -1)
        return dict(zip(top.indices.tolist(), probs.tolist(), strict=True))

    first = dist(prompt)
    second: dict[int, float] = {}
    for t1, p1 in first.items():
        for t2, p2 in dist(prompt + [t1]).items():
            second[t2] = second.get(t2, 0.0) + p1 * p2
    return first, second


def _chi2_pvalue(counts: dict[int, int], expected: dict[int, float]) -> float:
    import torch

    n = sum(counts.values())
    assert set(counts) <= set(expected), "a token outside the top-k was sampled"
    stat = sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in expected.items())
    df = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def test_sampling_distribution_is_the_targets(ckpt_root: str) -> None:
    """Rejection by comparison with the model's own sample keeps the target distribution:
    the first two tokens of 3000 seeded draws, with and without a one-token draft that is
    right about one time in nine, pass a chi-square test against the exact distribution,
    and the seeded tokens are the same draw for draw."""
    path = _checkpoint("qwen2", ckpt_root)
    prompt = repeating_prompts(11, (12,))[0]
    top_k = 4
    first, second = _target(path, prompt, top_k)
    likely = sorted(second, key=second.get, reverse=True)
    n = 3000
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, seed=i,
                             ignore_eos=True) for i in range(n)]
    runs = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 1,
                        "disable_by_batch_size": None}):
        llm = LLM(str(path), backend="local", speculative_config=spec)
        try:
            if spec is not None:
                llm.engine.drafter.proposer = _Guesser(likely[:2] + [7, 8])
            outs = llm.generate([prompt] * n, params, use_tqdm=False)
            stats = llm.stats()
        finally:
            llm.shutdown()
        runs[spec is None] = [o.outputs[0].token_ids for o in outs]
        for pos, expected in ((0, first), (1, second)):
            counts: dict[int, int] = {}
            for toks in runs[spec is None]:
                counts[toks[pos]] = counts.get(toks[pos], 0) + 1
            assert _chi2_pvalue(counts, expected) > 1e-3, (pos, counts, expected)
        if spec is not None:
            accepted = stats["spec_decode_num_accepted_tokens"]
            assert stats["spec_decode_num_draft_tokens"] == n
            assert 0.05 * n < accepted < 0.8 * n  # sometimes right, sometimes wrong
    assert runs[True] == runs[False]


def test_every_sampling_feature_draws_the_same_with_drafts(ckpt_root: str) -> None:
    """Seeded draws take their noise from (seed, position), and a draft is kept only where it
    equals the model's own sample, so with penalties, logit bias, min-p, top-k/top-p, n > 1,
    a JSON schema and logprobs, speculation changes no token (and no logprob beyond float
    noise of the batched pass)."""
    from helpers.schemas import BOUNDED_SCHEMAS

    from pagedserve.messages import StructuredOutputsParams

    path = _checkpoint("llama", ckpt_root)
    prompts = repeating_prompts(21, (5, 30))
    sampled = dict(max_tokens=30, temperature=1.0, ignore_eos=True)
    variants = [
        SamplingParams(**sampled, top_p=0.9, seed=1, n=3),
        SamplingParams(**sampled, top_k=20, min_p=0.05, seed=2, repetition_penalty=1.3,
                       presence_penalty=0.5, frequency_penalty=0.3,
                       logit_bias={prompts[0][1]: 3.0, 7: -100.0}),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, n=2, logprobs=2),
        SamplingParams(max_tokens=60, temperature=0.7, seed=3, structured_outputs=(
            StructuredOutputsParams(json=BOUNDED_SCHEMAS[0], disable_any_whitespace=True))),
    ]
    params = [p for p in variants for _ in prompts]
    runs = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                        "disable_by_batch_size": None}):
        outs, stats = _run(path, prompts * len(variants), params, block_size=8,
                           speculative_config=spec)
        runs.append(outs)
    _assert_speculated(stats)
    for plain, spec in zip(*runs, strict=True):
        assert len(plain.outputs) == len(spec.outputs)
        for a, b in zip(plain.outputs, spec.outputs, strict=True):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            if a.logprobs is not None:
                for la, lb in zip(a.logprobs, b.logprobs, strict=True):
                    assert la.keys() == lb.keys()
                    assert all(abs(la[t] - lb[t]) < 1e-4 for t in la)
    schema_outs = runs[1][-len(prompts):]
    import json

    import jsonschema
    for o in schema_outs:
        jsonschema.validate(json.loads(o.outputs[0].text), BOUNDED_SCHEMAS[0])
