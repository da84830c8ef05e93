"""The compiled CPU kernels on bfloat16 against float64 torch on the same bf16-rounded inputs.

The kernels widen bf16 exactly, compute in float32 and round each result to bf16 once, so the
stated bounds are a bf16 rounding of the result (half an ulp, 2^-9 relative; the bounds are
relative to the largest element, as ``kh.rel_err``): attention's output within 2^-8, its LSE
(float32, never rounded) within float32's 1e-5; RMSNorm rounds twice (the normalised row, then
its product with the weight, as Hugging Face does), so 2^-7. A float32 query over a bf16 cache
(the cache-dtype-only setting) is float32-exact on the widened cache.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.kernels import cpu as cpu_kernels
from pagedserve.kernels import (
    cpu_paged_attention,
    paged_attention,
    paged_attention_ref,
    reshape_and_cache,
    reshape_and_cache_ref,
)
from pagedserve.kernels import layer_ops as ops

BF16 = torch.bfloat16
OUT_TOL = 2.0**-8  # one bf16 rounding of the result, plus float32 summation
NORM_TOL = 2.0**-7  # two roundings
LSE_TOL = 1e-5  # float32


@pytest.fixture(autouse=True)
def _built() -> None:
    assert cpu_kernels.cpu_ops() is not None, "the compiled CPU kernels did not build"


def _attend(b, q, window, out_dtype):
    out = torch.full(q.shape, math.nan, dtype=out_dtype)
    lse = cpu_paged_attention(q, b.caches[0], out, b.cu_seqlens_q, b.seq_lens, b.block_table,
                              b.scale, window, True)
    return out, lse


# Every block size against GQA ratios 1, 3, 4, 8 (3: an odd group), head dims 64/72/128 and
# windows that start inside a block, over the conftest's mixed batch.
CASES = [
    (8, 1, 2, 64, None), (8, 4, 2, 128, 5), (16, 3, 2, 72, 9),
    (16, 8, 1, 64, 40), (32, 4, 2, 128, None), (32, 1, 1, 64, 5),
]


@pytest.mark.parametrize("block_size,group,h_kv,d,window", CASES)
def test_bf16_attention_matches_float64(kh, block_size, group, h_kv, d, window) -> None:
    b = kh.make_batch(*kh.mix(block_size), block_size, h_kv, group, d, dtype=BF16,
                      seed=block_size + d)
    want_out, want_lse = kh.dense_attention(b, window)  # float64 on the bf16 values
    out, lse = _attend(b, b.q, window, BF16)
    assert out.dtype == BF16 and lse.dtype == torch.float32
    assert kh.rel_err(out, want_out) <= OUT_TOL
    assert kh.rel_err(lse, want_lse) <= LSE_TOL
    # A float32 query over the bf16 cache: float32 throughout but for the cache's storage.
    out32, lse32 = _attend(b, b.q.float(), window, torch.float32)
    assert kh.rel_err(out32, want_out) <= kh.TOL[torch.float32]
    assert kh.rel_err(lse32, want_lse) <= LSE_TOL


@pytest.mark.parametrize("window", [None, 23])
def test_bf16_long_prefill_and_engine_dispatch(kh, window) -> None:
    """Several 16-query tiles per sequence; and the dispatcher as the engine calls it (with the
    step's plan cache), bf16 in and out, within the same bound."""
    b = kh.make_batch([70, 45, 1], [70, 45 + 37, 130], 16, 2, 4, 64, dtype=BF16, seed=9)
    want_out, want_lse = kh.dense_attention(b, window)
    out, lse = _attend(b, b.q, window, BF16)
    assert kh.rel_err(out, want_out) <= OUT_TOL and kh.rel_err(lse, want_lse) <= LSE_TOL
    got = torch.full_like(b.q, math.nan)
    paged_attention(b.q, b.caches[0], got, b.cu_seqlens_q, b.seq_lens, b.block_table, b.scale,
                    sliding_window=window, plans={})
    assert kh.rel_err(got, want_out) <= OUT_TOL


def test_dispatcher_sends_bf16_to_the_kernel(kh, monkeypatch) -> None:
    """bf16 on the CPU takes the compiled kernel (bit for bit its output), and the torch
    reference where the kernel cannot be built."""
    b = kh.make_batch(*kh.mix(16), 16, 2, 4, 64, dtype=BF16, seed=5)
    args = (b.caches[0], b.cu_seqlens_q, b.seq_lens, b.block_table, b.scale)
    got = torch.empty_like(b.q)
    lse = paged_attention(b.q, args[0], got, *args[1:], return_lse=True)
    out, want_lse = _attend(b, b.q, None, BF16)
    assert torch.equal(got, out) and torch.equal(lse, want_lse)
    monkeypatch.setattr("pagedserve.kernels.cpu_ops", lambda: None)
    monkeypatch.setattr(cpu_kernels, "cpu_ops", lambda: None)
    ref, fallback = torch.empty_like(b.q), torch.empty_like(b.q)
    paged_attention(b.q, args[0], fallback, *args[1:])
    paged_attention_ref(b.q, args[0], ref, *args[1:])
    assert torch.equal(fallback, ref)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.parametrize("t,h", [(1, 64), (37, 576), (130, 100)])
def test_bf16_norms(t, h) -> None:
    g = torch.Generator().manual_seed(t + h)
    wide = (torch.randn(t, 2 * h, generator=g) * 3).to(BF16)
    x = wide[:, :h]  # a strided view
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(BF16)
    got = ops.rms_norm(x, w, 1e-6)
    assert got.dtype == BF16 and got.shape == (t, h) and got.is_contiguous()
    assert _rel(got, ops.rms_norm_ref(x.double(), w.double(), 1e-6)) <= NORM_TOL
    # The bf16 torch expression rounds at the same two places: equal up to the sum's order.
    assert _rel(got, ops.rms_norm_ref(x, w, 1e-6)) <= 2.0**-8
    residual = (torch.randn(t, h, generator=g) * 2).to(BF16)
    want_sum = residual + x  # torch's bf16 add: float32 sum rounded to nearest even
    got = ops.add_rms_norm_(residual, x, w, 1e-6)
    assert torch.equal(residual, want_sum)
    assert _rel(got, ops.rms_norm_ref(want_sum.double(), w.double(), 1e-6)) <= NORM_TOL


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 1, 128)])
def test_bf16_rotary(hq, hkv, d) -> None:
    g = torch.Generator().manual_seed(hq * d)
    t = 29
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(BF16)
    q = qkv[:, : hq * d].view(t, hq, d)  # views of a fused projection, as the layer has them
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    pos = torch.randint(0, 300, (t,), generator=g)
    ang = torch.randn(300, d // 2, generator=g) * 5
    got_q, got_k = ops.rotary(q, k, pos, ang.cos(), ang.sin())  # float32 tables, as the model's
    assert got_q.dtype == BF16 and got_q.is_contiguous() and got_k.is_contiguous()
    want_q, want_k = ops.rotary_ref(q.double(), k.double(), pos, ang.cos().double(),
                                    ang.sin().double())
    assert _rel(got_q, want_q) <= OUT_TOL and _rel(got_k, want_k) <= OUT_TOL


def test_bf16_silu_and_mul() -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(45, 2 * 1536, generator=g) * 6).to(BF16)
    got = ops.silu_and_mul(x)
    assert got.dtype == BF16 and got.shape == (45, 1536)
    assert _rel(got, ops.silu_and_mul_ref(x.double())) <= OUT_TOL


def test_bf16_cache_write_and_rounding() -> None:
    """bf16 keys into a bf16 cache are copied; float32 ones into a bf16 cache are rounded as
    torch rounds (nearest even; ties, overflow to inf, NaN, -0 and subnormals included; the
    mixed case through the kernel itself, as the dispatcher keeps one dtype)."""
    g = torch.Generator().manual_seed(5)
    t, hkv, d, bs, nb = 21, 2, 64, 8, 12
    kv = torch.randn(t, 3 * hkv * d, generator=g)
    special = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.4e38, -3.4e38, math.inf,
                            math.nan, -0.0, 1e-40, 2**-126, 65504.0, 1 + 2**-9])
    kv[0, : special.numel()] = special
    key = kv[:, : hkv * d].view(t, hkv, d)
    value = kv[:, hkv * d : 2 * hkv * d].view(t, hkv, d)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[[3, 10]] = -1  # another CP rank's tokens
    for src in (key, value), (key.to(BF16), value.to(BF16)):
        got = torch.zeros(nb, 2, bs, hkv, d, dtype=BF16)
        want = torch.zeros(nb, 2, bs, hkv, d, dtype=BF16)
        reshape_and_cache(*src, got, slots.int())  # float32 keys narrowed to the bf16 cache too
        reshape_and_cache_ref(key.to(BF16), value.to(BF16), want, slots)  # torch's rounding
        # Bit for bit but NaN, which stays a NaN (torch's payload differs: no one reads it).
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(got.isnan(), want.isnan()) and bool(got.isnan().any())
