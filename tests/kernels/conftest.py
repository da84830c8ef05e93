"""Helpers for the kernel tests, handed to tests through the ``kh`` fixture.

(With ``--import-mode=importlib`` test modules cannot import each other, so shared helpers live
here behind a fixture.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from pagedserve.kernels import cp_owner_and_offset, reshape_and_cache_ref

# Tolerances: float32 results must match the float64 dense attention to rel. 1e-5 (max abs error
# over max abs value). On GPU, bf16 is checked at 2e-2 and fp16 at 5e-3 against the float32
# reference of the same bf16/fp16-rounded inputs (see benchmarks/scripts/kernels_gpu.py).
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 5e-3}
PAD_BLOCK_ID = 1 << 20  # unused block-table entries point far outside the cache


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), "result has NaN/inf (an element was not written?)"
    scale = max(want.abs().max().item(), 1e-30)
    return (got - want).abs().max().item() / scale


@dataclass
class Batch:
    q: torch.Tensor  # [T_q, H_q, D]
    keys: list[torch.Tensor]  # per sequence [L, H_kv, D], token order (the ground truth)
    values: list[torch.Tensor]
    caches: list[torch.Tensor]  # one paged cache per cp rank, [NB, 2, B, H_kv, D]
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [S, max_blocks] int32, scattered physical ids
    q_lens: list[int]
    scale: float


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    h_kv: int,
    group: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.float32,
    cp_size: int = 1,
    cp_interleave: int = 1,
    seed: int = 0,
    extra_blocks: int = 3,
) -> Batch:
    """A random batch whose KV is written, through the CP slot formula, into scattered blocks."""
    # Two streams: the data (q, K, V) depends only on the seed and the shapes, so a batch built with
    # another cp_size or block size holds the same tokens; the layout has its own stream.
    g = torch.Generator().manual_seed(seed)
    lay = torch.Generator().manual_seed(seed + 7919)
    keys = [torch.randn(n, h_kv, head_dim, generator=g).to(dtype) for n in seq_lens]
    values = [torch.randn(n, h_kv, head_dim, generator=g).to(dtype) for n in seq_lens]
    q = torch.randn(sum(q_lens), h_kv * group, head_dim, generator=g).to(dtype)
    vb = block_size * cp_size
    nvb = [math.ceil(n / vb) for n in seq_lens]
    num_blocks = sum(nvb) + extra_blocks
    perm = torch.randperm(num_blocks, generator=lay)
    max_blocks = max(nvb) + 1
    table = torch.full((len(seq_lens), max_blocks), PAD_BLOCK_ID, dtype=torch.int32)
    used = 0
    for s, n in enumerate(nvb):
        table[s, :n] = perm[used : used + n].to(torch.int32)
        used += n
    caches = [
        torch.randn(num_blocks, 2, block_size, h_kv, head_dim, generator=lay).to(dtype)
        for _ in range(cp_size)
    ]
    for s, n in enumerate(seq_lens):
        k, v = keys[s], values[s]
        pos = torch.arange(n)
        owner, local = cp_owner_and_offset(pos, block_size, cp_size, cp_interleave)
        slot = table[s, pos // vb].long() * block_size + local
        for r in range(cp_size):
            reshape_and_cache_ref(k, v, caches[r], torch.where(owner == r, slot, -1))
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return Batch(q, keys, values, caches, cu, torch.tensor(seq_lens, dtype=torch.int32),
                 table, list(q_lens), 1.0 / math.sqrt(head_dim))


def dense_attention(b: Batch, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention over keys in token order with a full softmax: (out, lse)."""
    hq = b.q.shape[1]
    outs, lses = [], []
    for s, q_len in enumerate(b.q_lens):
        k, v = b.keys[s].double(), b.values[s].double()
        n = k.shape[0]
        g = hq // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [L, H_q, D]
        q = b.q[int(b.cu_seqlens_q[s]) : int(b.cu_seqlens_q[s + 1])].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * b.scale
        qpos = torch.arange(n - q_len, n).unsqueeze(1)
        kpos = torch.arange(n).unsqueeze(0)
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        scores = scores.masked_fill(~mask, -math.inf)
        lse = torch.logsumexp(scores, dim=-1)  # [H, q]
        p = torch.softmax(scores, dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def mix(block_size: int) -> tuple[list[int], list[int]]:
    """(q_lens, seq_lens): prefill, chunked continuation, multi-token step, decodes (one an exact
    multiple of the block size)."""
    q_lens = [19, 13, 3, 1, 1, 1, 1]
    seq_lens = [19, 13 + 2 * block_size + 3, 40, 4 * block_size, 1, 97, 6]
    return q_lens, seq_lens


def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, math.nan)


@pytest.fixture
def kh() -> SimpleNamespace:
    return SimpleNamespace(
        TOL=TOL, rel_err=rel_err, make_batch=make_batch, dense_attention=dense_attention,
        poisoned=poisoned, Batch=Batch, PAD_BLOCK_ID=PAD_BLOCK_ID, mix=mix,
    )
