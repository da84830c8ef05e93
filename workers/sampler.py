"""Batched sampling: penalties, greedy, temperature, min-p, top-k, top-p, seeds, logprobs.

Order per row: raw log-probabilities (the reported logprobs) -> the structured-output and
``allowed_token_ids`` mask -> ``logit_bias`` -> stop tokens masked while a request has fewer
than ``min_tokens`` outputs (unless that leaves the grammar nothing) -> repetition / presence /
frequency penalties -> greedy argmax, or temperature -> min-p -> top-k -> top-p -> sample.
Sampling is an exponential race (``argmax(p / E)`` with ``E ~ Exp(1)`` per token). A seeded
request's noise row for the sample that produces its output token ``j`` comes from a generator
seeded with ``noise_seed(seed, j)``: a function of the request and the position alone, so the
draw is the same whatever shares the batch, however many positions a step samples (drafts) and
however often the position is sampled again (a preempted or failed-over request recomputing).
Unseeded rows share one generator and one batched draw.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from pagedserve.kernels.argmax import argmax
from pagedserve.messages import SamplingParams

_MASK64 = (1 << 64) - 1


def stop_tokens(p: SamplingParams, eos_token_ids: Collection[int]) -> set[int]:
    """The tokens that end a request once ``min_tokens`` allows a stop: its stop token ids,
    and EOS unless it is ignored."""
    return set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))


def noise_seed(seed: int, index: int) -> int:
    """The generator seed of a seeded request's sample of output token ``index`` (0-based).
    splitmix64's finaliser over ``seed`` advanced ``index + 1`` golden-ratio steps: nearby
    ``(seed, index)`` pairs get unrelated streams, and ``index`` never collides within a seed."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def exponential_noise(
    gen: torch.Generator | None, vocab_size: int, device: torch.device
) -> torch.Tensor:
    """One ``[vocab_size]`` row of Exp(1) noise drawn from ``gen``."""
    return torch.empty(vocab_size, device=device).exponential_(generator=gen)


@dataclass(slots=True)
class SamplingMetadata:
    """Per sampled row (N rows), already on the logits' device."""

    temperature: torch.Tensor  # [N] float32; 0 = greedy
    top_k: torch.Tensor  # [N] int64; <= 0 = off
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    noise_seeds: list[int | None]  # [N] ``noise_seed`` of a seeded sample; None: shared noise
    num_logprobs: list[int | None]  # [N]
    repetition_penalty: torch.Tensor | None = None  # [N]; None when no row uses penalties
    presence_penalty: torch.Tensor | None = None  # [N]
    frequency_penalty: torch.Tensor | None = None  # [N]
    prompt_tokens: torch.Tensor | None = None  # [N, Lp] int64, padded with vocab_size
    output_tokens: torch.Tensor | None = None  # [N, Lo] int64, padded with vocab_size
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    """(row, token) pairs that may not be sampled this step: stop tokens before min_tokens."""
    allowed: torch.Tensor | None = None
    """[N, V] bool: the tokens each row's grammar and ``allowed_token_ids`` admit (rows with
    neither admit all); None when no row is constrained."""
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """``logit_bias`` as (row [B], token [B], bias [B] float32) triples; None when no row has
    one."""

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())


@dataclass(slots=True)
class SamplerOutput:
    sampled: torch.Tensor  # [N] int64
    logprob_ids: torch.Tensor | None = None  # [N, 1 + k] int64: sampled, top-1..top-k
    logprobs: torch.Tensor | None = None  # [N, 1 + k] float32


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] int32 words (bit ``t % 32`` of word ``t // 32`` for token ``t``) -> [N, V] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [N, W, 32]; >> is arithmetic, & 1 keeps one bit
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


def _token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # tokens: [N, L] padded with vocab_size -> counts [N, vocab_size]
    counts = torch.zeros(tokens.shape[0], vocab_size + 1, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=counts.dtype))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition over prompt + output (divide positive logits, multiply negative ones);
    presence and frequency subtract over output tokens only, as the OpenAI API defines them."""
    if md.repetition_penalty is None or md.output_tokens is None or md.prompt_tokens is None:
        return logits
    v = logits.shape[1]
    out_counts = _token_counts(md.output_tokens, v)  # [N, V]
    seen = (_token_counts(md.prompt_tokens, v) > 0) | (out_counts > 0)
    rep = md.repetition_penalty.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    assert md.frequency_penalty is not None and md.presence_penalty is not None
    logits = logits - md.frequency_penalty.unsqueeze(1) * out_counts
    return logits - md.presence_penalty.unsqueeze(1) * (out_counts > 0).to(logits.dtype)


def restrict_support(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """min-p, then top-k, then top-p; masked tokens get -inf. logits: [N, V], temperature-scaled."""
    v = logits.shape[1]
    if bool((md.min_p > 0).any()):
        probs = logits.softmax(-1)
        keep = probs >= md.min_p.unsqueeze(1) * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(~keep, float("-inf"))
    use_k = (md.top_k > 0) & (md.top_k < v)
    use_p = md.top_p < 1.0
    if not bool(use_k.any()) and not bool(use_p.any()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    rank = torch.arange(v, device=logits.device).unsqueeze(0)
    k = torch.where(use_k, md.top_k, v).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(-1)
    # Drop a token when the mass strictly before it already reaches top_p (the top one stays).
    before = probs.cumsum(-1) - probs
    top_p = torch.where(use_p, md.top_p, 2.0).unsqueeze(1)  # 2.0: never reached
    sorted_logits = sorted_logits.masked_fill(before >= top_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # Re-seeded for each seeded sample: its noise is a function of (seed, position) only.
        self._seeded = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        # logits: [N, V] float32
        raw_logprobs = None
        if any(n is not None for n in md.num_logprobs):
            raw_logprobs = logits.log_softmax(-1)
        if md.allowed is not None:
            logits = logits.masked_fill(~md.allowed, float("-inf"))
        if md.bias is not None:
            logits = logits.index_put(md.bias[:2], md.bias[2], accumulate=True)
        if md.banned is not None:
            kept = logits
            logits = logits.index_put(md.banned, torch.tensor(float("-inf"), device=logits.device))
            if md.allowed is not None:
                # A grammar that admits only stop tokens outranks min_tokens.
                empty = torch.isinf(logits).all(-1, keepdim=True)
                logits = torch.where(empty, kept, logits)
        logits = apply_penalties(logits, md)
        sampled = argmax(logits)
        if not md.all_greedy:
            sampled = torch.where(md.temperature == 0, sampled, self._sample(logits, md))
        out = SamplerOutput(sampled=sampled)
        if raw_logprobs is not None:
            k = max(n or 0 for n in md.num_logprobs)
            top_lp, top_ids = raw_logprobs.topk(k, dim=-1) if k else (None, None)
            ids = sampled.unsqueeze(1)
            out.logprob_ids = ids if top_ids is None else torch.cat([ids, top_ids], dim=1)
            out.logprobs = raw_logprobs.gather(1, out.logprob_ids)
        return out

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        n, v = logits.shape
        temp = torch.where(md.temperature == 0, 1.0, md.temperature).unsqueeze(1)
        probs = restrict_support(logits / temp, md).softmax(-1)
        noise = torch.empty_like(probs)
        seeded = [(i, s) for i, s in enumerate(md.noise_seeds) if s is not None]
        if len(seeded) < n:
            noise.exponential_(generator=self.generator)
        for i, s in seeded:
            self._seeded.manual_seed(s)
            noise[i] = exponential_noise(self._seeded, v, logits.device)
        return argmax(probs / noise)
