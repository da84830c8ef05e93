"""merge_attn_states: LSE merge against a float64 formula, with empty (-inf/NaN/+inf) shards."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.kernels import (
    KernelArgumentError,
    KernelDtypeError,
    merge_attn_states,
    merge_attn_states_ref,
    triton_merge_attn_states,
)

IMPLS = {"ref": merge_attn_states_ref, "triton": triton_merge_attn_states,
         "dispatch": merge_attn_states}


def _case(n: int, t: int, h: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    outputs = torch.randn(n, t, h, d, generator=g)
    lses = torch.randn(n, t, h, generator=g) * 4
    return outputs, lses


def _expected(outputs: torch.Tensor, lses: torch.Tensor):
    """float64: out = sum_r softmax_r(lse) out_r over the non-empty shards."""
    lse = lses.double()
    empty = ~torch.isfinite(lse)
    lse = lse.masked_fill(empty, -math.inf)
    merged = torch.logsumexp(lse, dim=0)
    w = torch.exp(lse - merged.masked_fill(torch.isinf(merged), 0.0))
    o = outputs.double().masked_fill(empty.unsqueeze(-1), 0.0)
    out = (w.unsqueeze(-1) * o).sum(0)
    return out.masked_fill(torch.isinf(merged).unsqueeze(-1), 0.0), merged


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("n,t,h,d", [(1, 5, 2, 64), (2, 7, 4, 128), (3, 4, 3, 72), (5, 6, 2, 16)])
def test_merge_matches_float64(kh, impl, n, t, h, d) -> None:
    outputs, lses = _case(n, t, h, d, seed=n * 100 + d)
    if n > 1:
        # Empty shards in every flavour; their outputs are garbage and must not leak.
        lses[0, 0, 0] = -math.inf
        lses[1, 1, :] = math.nan
        lses[n - 1, 2, 0] = math.inf
        outputs[0, 0, 0] = math.nan
        outputs[1, 1] = math.inf
        outputs[n - 1, 2, 0] = math.nan
        lses[:, 3, 1] = -math.inf  # every shard empty: output 0, lse -inf
    out, lse = IMPLS[impl](outputs, lses)
    want_out, want_lse = _expected(outputs, lses)
    assert out.shape == (t, h, d) and lse.shape == (t, h) and lse.dtype == torch.float32
    assert kh.rel_err(out, want_out) <= kh.TOL[torch.float32]
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[~finite] == -math.inf).all()
    assert kh.rel_err(lse[finite], want_lse[finite]) <= kh.TOL[torch.float32]


@pytest.mark.parametrize("impl", list(IMPLS))
def test_merge_rejects_bad_arguments(impl) -> None:
    outputs, lses = _case(2, 3, 2, 16, seed=1)
    with pytest.raises(KernelArgumentError, match="outputs.shape"):
        IMPLS[impl](outputs, lses[:, :2])
    with pytest.raises(KernelDtypeError, match="lses"):
        IMPLS[impl](outputs, lses.half())
    with pytest.raises(KernelArgumentError, match="outputs must be"):
        IMPLS[impl](outputs[0], lses[0])
