"""Sampler: greedy, restricted support, penalties, logprobs, and batch-independent seeds."""

from __future__ import annotations

import pytest
import torch

from pagedserve.workers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    noise_seed,
    restrict_support,
)

CPU = torch.device("cpu")
V = 32


def md(n: int, **kw) -> SamplingMetadata:
    base = {
        "temperature": torch.ones(n),
        "top_k": torch.zeros(n, dtype=torch.int64),
        "top_p": torch.ones(n),
        "min_p": torch.zeros(n),
        "noise_seeds": [None] * n,
        "num_logprobs": [None] * n,
    }
    base.update(kw)
    return SamplingMetadata(**base)


def test_greedy_is_argmax():
    logits = torch.randn(3, V)
    out = Sampler(CPU)(logits, md(3, temperature=torch.zeros(3)))
    assert out.sampled.tolist() == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_whatever_the_batch():
    torch.manual_seed(0)
    target = torch.randn(1, V)

    def run(batch_logits: torch.Tensor, row: int, steps: int = 5) -> list[int]:
        n = batch_logits.shape[0]
        sampler = Sampler(CPU, seed=len(batch_logits))
        tokens = []
        for j in range(steps):
            seeds: list[int | None] = [noise_seed(100 + i, j) for i in range(n)]
            seeds[row] = noise_seed(42, j)
            if n > 1:
                seeds[0 if row else 1] = None  # an unseeded neighbour uses the shared noise
            out = sampler(batch_logits.clone(), md(n, noise_seeds=seeds))
            tokens.append(int(out.sampled[row]))
        return tokens

    alone = run(target, 0)
    crowded = run(torch.cat([torch.randn(3, V), target, torch.randn(2, V)]), 3)
    assert alone == crowded
    assert len(set(alone)) > 1  # it really samples


def test_a_seeded_sample_depends_on_its_seed_and_position_only():
    """Sampling a position again (a resumed request), or sampling a later one first (drafts
    in one step), gives each position the token it gets in order, one step at a time."""
    torch.manual_seed(1)
    logits = torch.randn(1, V).repeat(6, 1)  # one distribution, six positions

    def one(j: int, sampler: Sampler) -> int:
        return int(sampler(logits[:1].clone(), md(1, noise_seeds=[noise_seed(7, j)])).sampled[0])

    in_order = [one(j, Sampler(CPU, seed=0)) for j in range(6)]
    assert len(set(in_order)) > 1
    again, shuffled = Sampler(CPU, seed=5), (3, 0, 5, 3, 1, 2, 4)
    assert [one(j, again) for j in shuffled] == [in_order[j] for j in shuffled]
    # One call sampling all six positions as rows (a row's drafts) agrees too.
    seeds = [noise_seed(7, j) for j in range(6)]
    batched = Sampler(CPU)(logits.clone(), md(6, noise_seeds=seeds))
    assert batched.sampled.tolist() == in_order
    # Distinct seeds and positions give distinct generator seeds.
    keys = {noise_seed(s, j) for s in range(50) for j in range(50)}
    assert len(keys) == 2500


def test_top_k_top_p_min_p_restrict_support():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    k2 = restrict_support(logits, md(1, top_k=torch.tensor([2])))
    assert torch.isfinite(k2).tolist() == [[True, True, False, False]]
    p = restrict_support(logits, md(1, top_p=torch.tensor([0.7])))
    assert torch.isfinite(p).tolist() == [[True, True, False, False]]  # 0.5 < 0.7 <= 0.75
    p_small = restrict_support(logits, md(1, top_p=torch.tensor([0.1])))
    assert torch.isfinite(p_small).tolist() == [[True, False, False, False]]
    m = restrict_support(logits, md(1, min_p=torch.tensor([0.3])))  # keep p >= 0.15
    assert torch.isfinite(m).tolist() == [[True, True, True, False]]
    # Sampling never leaves the support.
    big = torch.randn(4, V)
    meta = md(
        4,
        top_k=torch.tensor([3, 0, 0, 1]),
        top_p=torch.tensor([1.0, 0.3, 1.0, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.5, 0.0]),
    )
    allowed = torch.isfinite(restrict_support(big, meta))
    sampler = Sampler(CPU)
    for _ in range(50):
        s = sampler(big.clone(), meta).sampled
        assert allowed[torch.arange(4), s].all()
    assert allowed[0].sum() == 3 and allowed[3].sum() == 1


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    pad = 5
    meta = md(
        1,
        repetition_penalty=torch.tensor([2.0]),
        presence_penalty=torch.tensor([0.5]),
        frequency_penalty=torch.tensor([0.25]),
        prompt_tokens=torch.tensor([[0, 1, pad]]),
        output_tokens=torch.tensor([[2, 2, 0]]),
    )
    got = apply_penalties(logits.clone(), meta)[0].tolist()
    # token 0: prompt+output -> 2/2 = 1, once in output -> -0.25 - 0.5
    # token 1: prompt only -> -2*2 = -4 (no presence/frequency: prompt tokens do not count)
    # token 2: output twice -> 1/2 - 0.5 - 0.5;  tokens 3, 4 untouched
    assert got == pytest.approx([0.25, -4.0, -0.5, 0.5, 3.0])


def test_logprobs_are_raw_log_softmax():
    logits = torch.randn(2, V)
    meta = md(
        2,
        temperature=torch.tensor([0.0, 0.7]),
        repetition_penalty=torch.tensor([1.5, 1.5]),
        presence_penalty=torch.zeros(2),
        frequency_penalty=torch.zeros(2),
        prompt_tokens=torch.tensor([[1], [2]]),
        output_tokens=torch.tensor([[V], [V]]),
        num_logprobs=[3, 0],
    )
    out = Sampler(CPU)(logits.clone(), meta)
    ref = logits.log_softmax(-1)
    assert out.logprob_ids.shape == (2, 4)
    assert out.logprob_ids[:, 0].tolist() == out.sampled.tolist()
    assert torch.allclose(out.logprobs, ref.gather(1, out.logprob_ids))
    assert out.logprob_ids[0, 1:].tolist() == ref[0].topk(3).indices.tolist()


def test_unpack_bitmask_is_little_endian_bits_of_int32_words():
    import numpy as np

    from pagedserve.workers.sampler import unpack_bitmask

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(3, 8), dtype=np.uint8)  # 3 rows of 2 words, 64 tokens
    want = np.unpackbits(raw, axis=1, bitorder="little")[:, :50].astype(bool)
    words = torch.from_numpy(raw.view(np.int32).copy())  # the sign bit is token 31 / 63
    assert (unpack_bitmask(words, 50).numpy() == want).all()


def test_a_grammar_mask_bounds_greedy_and_sampled_tokens():
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    allowed = torch.zeros(4, V, dtype=torch.bool)
    allowed[:, 3:7] = True
    allowed[1] = False
    allowed[1, 30] = True  # one admitted token, however low its logit
    logits[1, 30] = -50.0
    greedy = Sampler(CPU)(logits, md(4, temperature=torch.zeros(4), allowed=allowed)).sampled
    assert greedy.tolist() == logits.masked_fill(~allowed, -1e9).argmax(-1).tolist()
    sampler = Sampler(CPU, seed=3)
    for _ in range(50):
        drawn = sampler(logits, md(4, temperature=torch.full((4,), 2.0), allowed=allowed)).sampled
        assert allowed[torch.arange(4), drawn].all()


def test_logit_bias_adds_to_the_logits_after_the_mask_and_leaves_logprobs_raw():
    torch.manual_seed(2)
    logits = torch.randn(3, V)
    rows, toks = torch.tensor([0, 1, 1]), torch.tensor([7, 7, 2])
    values = torch.tensor([100.0, -100.0, 100.0])
    greedy = md(3, temperature=torch.zeros(3), num_logprobs=[0, 0, 0])
    greedy.bias = (rows, toks, values)
    out = Sampler(CPU)(logits, greedy)
    want = logits.double().clone()
    want[rows, toks] += values.double()  # float64 reference
    assert out.sampled.tolist() == want.argmax(-1).tolist() == [7, 2, int(logits[2].argmax())]
    raw = logits.double().log_softmax(-1)
    assert torch.allclose(out.logprobs[:, 0].double(), raw[torch.arange(3), out.sampled],
                          atol=1e-5)
    # A biased token the mask forbids stays forbidden.
    allowed = torch.ones(3, V, dtype=torch.bool)
    allowed[0, 7] = False
    greedy.allowed = allowed
    assert Sampler(CPU)(logits, greedy).sampled[0] != 7
