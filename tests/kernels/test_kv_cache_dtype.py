"""A KV cache of its own dtype (bfloat16, scaled fp8 e4m3) under float32 activations: the write
quantizes and attention widens, in the torch reference, the compiled CPU kernels and the Triton
kernels (interpreter on CPU), against float64.

Tolerances. Write: a stored element reads back within half an ulp of the float64 value,
``|x| * 2^-8`` for bfloat16 (8 significant bits) and ``|x| * 2^-4 + scale * 2^-10`` for e4m3
(4 significant bits, subnormal step 2^-9), and fp8 saturates at +-448 * scale instead of
overflowing. Read: attention over the quantized cache equals float64 attention over the
dequantized values to float32's 1e-5 (the read itself adds no error), and float64 attention over
the original values to 2e-2 (bfloat16) / 1.5e-1 (fp8; max abs error over max abs value).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pagedserve.kernels import (
    FP8_E4M3,
    FP8_MAX,
    KernelArgumentError,
    KernelDtypeError,
    copy_blocks,
    dequantize_kv,
    paged_attention,
    paged_attention_ref,
    quantize_kv,
    reshape_and_cache,
    reshape_and_cache_ref,
    swap_blocks,
    triton_paged_attention,
    triton_reshape_and_cache,
)

WRITE_IMPLS = {"ref": reshape_and_cache_ref, "triton": triton_reshape_and_cache}
READ_IMPLS = {"ref": paged_attention_ref, "triton": triton_paged_attention}
# (cache dtype, k_scale, v_scale): bf16 unscaled, fp8 at the default 1.0 and calibrated scales.
KV_CASES = [(torch.bfloat16, 1.0, 1.0), (FP8_E4M3, 1.0, 1.0), (FP8_E4M3, 0.0125, 0.03)]
READ_TOL = {torch.bfloat16: 2e-2, FP8_E4M3: 1.5e-1}


def _rounding_bound(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return x.abs() * 2.0**-8
    return x.abs() * 2.0**-4 + scale * 2.0**-10


def _write_case(seed: int, scale: float):
    g = torch.Generator().manual_seed(seed)
    nb, bs, hkv, d, t = 6, 8, 2, 32, 13
    key = torch.randn(t, hkv, d, generator=g) * 3
    value = torch.randn(t, hkv, d, generator=g) * 3
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 500.0, -449.0]) * scale  # past the fp8 range
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[3] = -1  # skipped
    return key, value, slots, (nb, 2, bs, hkv, d)


@pytest.mark.parametrize("impl", list(WRITE_IMPLS))
@pytest.mark.parametrize("dtype,k_scale,v_scale", KV_CASES)
def test_write_quantizes_within_half_an_ulp(impl, dtype, k_scale, v_scale) -> None:
    key, value, slots, shape = _write_case(3, k_scale)
    cache = torch.zeros(shape, dtype=dtype)
    before = cache.clone()
    WRITE_IMPLS[impl](key, value, cache, slots, k_scale, v_scale)
    bs = shape[2]
    written = torch.zeros(shape[0] * 2 * bs, dtype=torch.bool)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        blk, off = divmod(slot, bs)
        for kv, (x, s) in enumerate(((key[i], k_scale), (value[i], v_scale))):
            got = cache[blk, kv, off].double() * s
            want = x.double()
            if dtype == FP8_E4M3:  # saturation, not NaN or inf
                want = want.clamp(-FP8_MAX * s, FP8_MAX * s)
            err = (got - want).abs()
            assert bool((err <= _rounding_bound(want, dtype, s) + 1e-12).all()), (i, kv)
            written[blk * 2 * bs + kv * bs + off] = True
    rows = cache.view(-1, shape[3] * shape[4]).float()
    assert torch.equal(rows[~written], before.view(-1, shape[3] * shape[4]).float()[~written])
    if dtype == FP8_E4M3:
        assert cache[divmod(int(slots[0]), bs)[0], 0, int(slots[0]) % bs, 0, :2].float().tolist() \
            == [FP8_MAX, -FP8_MAX]


@pytest.mark.parametrize("dtype,k_scale,v_scale", KV_CASES)
def test_triton_write_matches_reference_bytes(dtype, k_scale, v_scale) -> None:
    key, value, slots, shape = _write_case(5, k_scale)
    want = torch.zeros(shape, dtype=dtype)
    got = torch.zeros(shape, dtype=dtype)
    reshape_and_cache_ref(key, value, want, slots, k_scale, v_scale)
    triton_reshape_and_cache(key, value, got, slots, k_scale, v_scale)
    # Bit for bit: the kernel rounds to nearest-even itself, as torch's cast does.
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _quantized_batch(kh, dtype, k_scale, v_scale, block_size, h_kv, group, d, seed):
    """make_batch's sequences written into a cache of ``dtype``; returns (batch whose keys and
    values are the dequantized float64 ones, the original float32 batch, the cache)."""
    b = kh.make_batch(*kh.mix(block_size), block_size, h_kv, group, d, seed=seed)
    cache = torch.zeros(b.caches[0].shape, dtype=dtype)
    for s, n in enumerate(b.seq_lens.tolist()):
        pos = torch.arange(n)
        slot = b.block_table[s, pos // block_size].long() * block_size + pos % block_size
        reshape_and_cache_ref(b.keys[s], b.values[s], cache, slot, k_scale, v_scale)
    deq = dataclasses.replace(
        b,
        keys=[dequantize_kv(quantize_kv(k, dtype, k_scale), torch.float64, k_scale)
              for k in b.keys],
        values=[dequantize_kv(quantize_kv(v, dtype, v_scale), torch.float64, v_scale)
                for v in b.values],
    )
    return deq, b, cache


# (impl, block size, q heads per kv head, kv heads, head dim, window); the interpreter runs two.
READ_CASES = [
    ("ref", 8, 4, 2, 64, None), ("ref", 16, 1, 2, 32, 5), ("ref", 32, 3, 2, 64, 40),
    ("triton", 16, 4, 2, 32, None), ("triton", 8, 2, 1, 32, 9),
]


@pytest.mark.parametrize("impl,block_size,group,h_kv,d,window", READ_CASES)
@pytest.mark.parametrize("dtype,k_scale,v_scale", KV_CASES)
def test_read_dequantizes(kh, impl, block_size, group, h_kv, d, window, dtype, k_scale,
                          v_scale) -> None:
    # Keys ~N(0, 1): scales below 1 keep them inside the fp8 range (448 * 0.0125 = 5.6).
    deq, orig, cache = _quantized_batch(kh, dtype, k_scale, v_scale, block_size, h_kv, group, d,
                                        seed=block_size + d)
    out = torch.full_like(orig.q, math.nan)
    lse = READ_IMPLS[impl](orig.q, cache, out, orig.cu_seqlens_q, orig.seq_lens,
                           orig.block_table, orig.scale, sliding_window=window,
                           return_lse=True, k_scale=k_scale, v_scale=v_scale)
    exact_out, exact_lse = kh.dense_attention(deq, window)
    assert kh.rel_err(out, exact_out) <= kh.TOL[torch.float32]
    assert kh.rel_err(lse, exact_lse) <= kh.TOL[torch.float32]
    true_out, _ = kh.dense_attention(orig, window)
    assert kh.rel_err(out, true_out) <= READ_TOL[dtype]


# The compiled CPU kernels: (block size, q heads per kv head, kv heads, head dim, window). Head
# dims 32, 64 and 128 take the vectorised path (64 with 12 kv heads: a decode's heads together,
# several items a sequence), 72 and a group of 8 the portable one.
CPU_CASES = [(16, 3, 3, 64, None), (8, 4, 2, 128, 5), (32, 1, 2, 32, 40), (16, 3, 12, 64, None),
             (16, 2, 2, 72, 9), (16, 8, 1, 64, None)]
# A bf16 query rounds the probabilities and the output to bf16 (test_cpu_bf16.py's bound).
CPU_TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8}


@pytest.mark.parametrize("block_size,group,h_kv,d,window", CPU_CASES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype,k_scale,v_scale", KV_CASES)
def test_cpu_kernel_reads_a_narrow_cache(kh, monkeypatch, block_size, group, h_kv, d, window,
                                         q_dtype, dtype, k_scale, v_scale) -> None:
    """The compiled kernel widens the cache exactly and scales in float32: float64 attention over
    the dequantized values, within float32's (bf16's) bound; reached through the dispatcher."""
    if q_dtype == torch.bfloat16 and dtype == torch.bfloat16:
        pytest.skip("a bf16 cache under bf16 activations is the model's dtype: test_cpu_bf16")
    deq, orig, cache = _quantized_batch(kh, dtype, k_scale, v_scale, block_size, h_kv, group, d,
                                        seed=block_size + d + h_kv)
    q = orig.q.to(q_dtype)
    deq = dataclasses.replace(deq, q=q.double())
    out = torch.full_like(q, math.nan)
    monkeypatch.setattr("pagedserve.kernels.paged_attention_ref", None)  # the kernel's answer
    lse = paged_attention(q, cache, out, orig.cu_seqlens_q, orig.seq_lens, orig.block_table,
                          orig.scale, sliding_window=window, return_lse=True, k_scale=k_scale,
                          v_scale=v_scale, plans={})
    exact_out, exact_lse = kh.dense_attention(deq, window)
    assert kh.rel_err(out, exact_out) <= CPU_TOL[q_dtype]
    assert kh.rel_err(lse, exact_lse) <= kh.TOL[torch.float32]


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype,k_scale,v_scale", KV_CASES)
def test_cpu_kernel_writes_the_reference_bytes(monkeypatch, src_dtype, dtype, k_scale,
                                               v_scale) -> None:
    key, value, slots, shape = _write_case(7, k_scale)
    key, value = key.to(src_dtype), value.to(src_dtype)
    want, got = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    reshape_and_cache_ref(key, value, want, slots, k_scale, v_scale)
    monkeypatch.setattr("pagedserve.kernels.reshape_and_cache_ref", None)
    reshape_and_cache(key, value, got, slots, k_scale, v_scale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_cpu_fp8_write_rounds_every_value_as_torch_does(monkeypatch) -> None:
    """Bit for bit with torch's cast: every e4m3 value, the midpoints between neighbours (ties
    to even), subnormals, saturation, values around the scale."""
    ladder = torch.arange(256, dtype=torch.uint8).view(FP8_E4M3).float()
    ladder = ladder[~ladder.isnan()].sort().values
    g = torch.Generator().manual_seed(0)
    x = torch.cat([ladder, (ladder[:-1] + ladder[1:]) / 2, torch.randn(4000, generator=g) * 30,
                   torch.randn(4000, generator=g) * 0.01,
                   torch.tensor([500.0, -500.0, 464.0, 2.0**-10, -3 * 2.0**-10, 1e-30])])
    x = x[: x.numel() // 64 * 64].view(-1, 1, 64)
    slots = torch.arange(x.shape[0])
    for scale in (1.0, 0.37):
        want = torch.zeros(x.shape[0], 2, 1, 1, 64, dtype=FP8_E4M3)
        got = torch.zeros_like(want)
        reshape_and_cache_ref(x, x, want, slots, scale, scale)
        with monkeypatch.context() as m:
            m.setattr("pagedserve.kernels.reshape_and_cache_ref", None)
            reshape_and_cache(x, x, got, slots, scale, scale)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_rejects_bad_scales_and_dtype_pairs() -> None:
    key, value, slots, shape = _write_case(2, 1.0)
    cache = torch.zeros(shape, dtype=FP8_E4M3)
    for bad in (0.0, -1.0, math.inf, math.nan, True):
        with pytest.raises(KernelArgumentError, match="k_scale"):
            reshape_and_cache_ref(key, value, cache, slots, bad, 1.0)
    # A float32 cache is no storage dtype: float64 activations must not be narrowed into it.
    with pytest.raises(KernelDtypeError, match="kv_cache dtype"):
        reshape_and_cache_ref(key.double(), value.double(), torch.zeros(shape), slots)


def test_cpu_dispatch_rejects_bad_scales_by_name(kh) -> None:
    """The compiled kernels take the scales as floats; the dispatcher refuses what the reference
    refuses (a bool would pass as 1.0), and the cache stays as it was."""
    key, value, slots, shape = _write_case(2, 1.0)
    cache = torch.zeros(shape, dtype=FP8_E4M3)
    _, b, read_cache = _quantized_batch(kh, FP8_E4M3, 1.0, 1.0, 16, 2, 4, 64, seed=3)
    out = torch.zeros_like(b.q)
    for bad in (0.0, -1.0, math.inf, math.nan, True):
        with pytest.raises(KernelArgumentError, match="k_scale"):
            reshape_and_cache(key, value, cache, slots, bad, 1.0)
        with pytest.raises(KernelArgumentError, match="v_scale"):
            paged_attention(b.q, read_cache, out, b.cu_seqlens_q, b.seq_lens, b.block_table,
                            b.scale, k_scale=1.0, v_scale=bad)
    assert not cache.view(torch.uint8).any() and not out.any()


def test_fp8_blocks_copy_and_swap_bytes_exactly() -> None:
    """Copy-on-write and the host tier move an fp8 cache's bytes (CPU index_copy_ has no fp8
    kernel: the copies go through a byte view)."""
    g = torch.Generator().manual_seed(0)
    dev = (torch.randn(5, 2, 4, 2, 8, generator=g) * 50).to(FP8_E4M3)
    host = torch.zeros(3, 2, 4, 2, 8, dtype=FP8_E4M3)
    swap_blocks([dev], [host], torch.tensor([[4, 1], [2, 2]]))
    assert torch.equal(host[1].view(torch.uint8), dev[4].view(torch.uint8))
    assert torch.equal(host[2].view(torch.uint8), dev[2].view(torch.uint8))
    back = dev.clone()
    swap_blocks([host], [back], torch.tensor([[1, 0]]))
    assert torch.equal(back[0].view(torch.uint8), dev[4].view(torch.uint8))
    copy_blocks([back], [[3, 1]])
    assert torch.equal(back[1].view(torch.uint8), dev[3].view(torch.uint8))
