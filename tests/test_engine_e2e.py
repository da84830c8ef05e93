"""The whole generate path in one process against Hugging Face transformers, token for token.

Each case builds a tiny random checkpoint with transformers, runs ``LLM.generate`` greedily in
float32 and compares with ``model.generate`` of the same checkpoint. The variants stress the
paged machinery (prefix hits, preemption by recompute, chunked prefill, block sizes), which
must never change a single token.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from helpers.checkpoints import KINDS, hf_greedy, load_hf_model, make_checkpoint

from pagedserve import LLM, SamplingParams

MAX_NEW = 32
# Varied lengths: a single token, a block multiple (16, 32, 64), a block + 1, and long ones.
PROMPT_LENS = (1, 5, 16, 17, 32, 45, 64, 100)
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@functools.cache
def _checkpoint(kind: str, root: str) -> Path:
    return make_checkpoint(kind, Path(root) / kind)


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ckpts"))


def _prompts(seed: int, lens: tuple[int, ...] = PROMPT_LENS, prefix: list[int] | None = None):
    import random

    rng = random.Random(seed)
    head = prefix or []
    return [head + [rng.randrange(3, 512) for _ in range(n)] for n in lens]


@functools.cache
def _reference(path: str, prompts: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    model = load_hf_model(path)
    return [hf_greedy(model, list(p), MAX_NEW) for p in prompts]


def _ours(path: Path, prompts: list[list[int]], params=GREEDY, **options):
    llm = LLM(str(path), backend="local", **options)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.stats()
    finally:
        llm.shutdown()


def _assert_same(ours: list[list[int]], ref: list[list[int]]) -> None:
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            pytest.fail(f"prompt {i} diverges at token {at}: {a} != {b}")


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_transformers(kind: str, ckpt_root: str) -> None:
    path = _checkpoint(kind, ckpt_root)
    prompts = _prompts(1)
    ours, _ = _ours(path, prompts)
    _assert_same(ours, _reference(str(path), tuple(map(tuple, prompts))))


@pytest.mark.parametrize("block_size", [8, 32])
def test_block_sizes(block_size: int, ckpt_root: str) -> None:
    path = _checkpoint("llama", ckpt_root)
    prompts = _prompts(1)
    ours, _ = _ours(path, prompts, block_size=block_size)
    _assert_same(ours, _reference(str(path), tuple(map(tuple, prompts))))


def test_prefix_caching_hits_and_equals(ckpt_root: str) -> None:
    path = _checkpoint("llama", ckpt_root)
    shared = _prompts(7, (40,))[0]
    prompts = _prompts(2, (3, 16, 20, 31), prefix=shared)
    llm = LLM(str(path), backend="local", enable_prefix_caching=True)
    try:
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    ours = [o.outputs[0].token_ids for o in first + rest]
    ref = _reference(str(path), tuple(map(tuple, prompts)))
    assert ours == ref
    assert stats["prefix_cache_hits"] > 0
    assert all(o.num_cached_tokens >= 32 for o in rest)  # two full blocks of the shared 40


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_preemption_by_recompute_equals(kind: str, ckpt_root: str) -> None:
    path = _checkpoint(kind, ckpt_root)
    prompts = _prompts(3)
    # 8 requests of up to 132 tokens need ~40 blocks at once; 24 forces preemptions.
    ours, stats = _ours(path, prompts, num_gpu_blocks=24, block_size=16)
    assert stats["num_preemptions"] > 0
    _assert_same(ours, _reference(str(path), tuple(map(tuple, prompts))))


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_preemption_by_swap_equals(kind: str, ckpt_root: str) -> None:
    path = _checkpoint(kind, ckpt_root)
    prompts = _prompts(3)  # the workload of the recompute case above, the same references
    ours, stats = _ours(path, prompts, num_gpu_blocks=24, block_size=16,
                        preemption_mode="swap", num_host_blocks=64)
    assert stats["num_preemptions"] > 0 and stats["kv_host_swap_fallbacks"] == 0
    assert stats["kv_host_swap_ins"] == stats["kv_host_swap_outs"] == stats["num_preemptions"]
    _assert_same(ours, _reference(str(path), tuple(map(tuple, prompts))))


def test_evicted_prefixes_served_from_the_host_tier_equal(ckpt_root: str) -> None:
    path = _checkpoint("llama", ckpt_root)
    heads = [_prompts(20 + f, (48,))[0] for f in range(3)]  # three blocks each
    prompts = [h + _prompts(30 + i, (5,))[0] for i, h in enumerate(heads * 2)]
    # 11 usable blocks of 16; a request takes 6, so a family's prefix is evicted from the
    # device before it comes back, and found in the host tier instead.
    llm = LLM(str(path), backend="local", num_gpu_blocks=12, block_size=16, num_host_blocks=32)
    try:
        outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert stats["prefix_cache_host_hits"] >= 3 * 48
    assert all(o.num_cached_tokens == 48 for o in outs[3:])
    _assert_same([o.outputs[0].token_ids for o in outs],
                 _reference(str(path), tuple(map(tuple, prompts))))


def test_chunked_prefill_equals(ckpt_root: str) -> None:
    path = _checkpoint("mistral", ckpt_root)  # sliding window 8 across chunk borders
    prompts = _prompts(4)
    ours, _ = _ours(path, prompts, max_num_batched_tokens=24)
    _assert_same(ours, _reference(str(path), tuple(map(tuple, prompts))))


def test_seeded_sampling_reproduces(ckpt_root: str) -> None:
    path = _checkpoint("qwen2", ckpt_root)
    prompts = _prompts(5, (4, 9))
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    a, _ = _ours(path, prompts, params)
    # The same seed in a different batch (more requests beside it) gives the same tokens.
    b, _ = _ours(path, prompts + _prompts(6, (7, 30)), params)
    assert a == b[:2]
    other = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    c, _ = _ours(path, prompts, other)
    assert c != a


def test_parallel_sampling_shares_prompt_blocks(ckpt_root: str) -> None:
    path = _checkpoint("llama", ckpt_root)
    prompt = _prompts(8, (48,))[0]  # three full blocks of 16
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    llm = LLM(str(path), backend="local", enable_prefix_caching=False, block_size=16)
    peak: list[int] = []
    copies: list[tuple[int, int]] = []

    def hook(sched, sched_out) -> None:
        peak.append(llm.engine.stats()["kv_blocks_used"])
        copies.extend(sched_out.block_copies)

    llm.engine.add_step_hook(hook)
    try:
        (out,) = llm.generate([prompt], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(out.outputs) == 4
    assert sorted(c.index for c in out.outputs) == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Unshared, 4 x 56 tokens would take 4 x 4 = 16 blocks. Shared: the two full prompt blocks
    # count once; the partial third is copied on write by three of the four children; each
    # child then fills one block of its own: 2 + 4 + 4.
    assert max(peak) == 10
    assert len(copies) == 3 and len({src for src, _ in copies}) == 1


def test_stop_token_ids_and_stop_strings(ckpt_root: str) -> None:
    path = _checkpoint("llama", ckpt_root)
    prompt = _prompts(9, (10,))[0]
    full = _reference(str(path), ((*prompt,),))[0]
    llm = LLM(str(path), backend="local")
    try:
        stop_tok = full[5]
        first = full.index(stop_tok)
        (out,) = llm.generate(
            [prompt],
            SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[stop_tok]),
            use_tqdm=False,
        )
        comp = out.outputs[0]
        assert comp.token_ids == full[: first + 1]
        assert comp.finish_reason == "stop" and comp.stop_reason == stop_tok

        text = llm.tokenizer.decode(full)
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        (out,) = llm.generate(
            [prompt],
            SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop=[stop], ignore_eos=True),
            use_tqdm=False,
        )
        comp = out.outputs[0]
        assert comp.finish_reason == "stop" and comp.stop_reason == stop
        assert comp.text == text[: text.index(stop)]
    finally:
        llm.shutdown()
