"""A layer's pointwise ops: the compiled CPU kernels against float64 torch (and the float32
torch expressions they replace), with inputs as the model hands them over (views of a fused
projection), and the cache write against the torch reference."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu as cpu_kernels
from pagedserve.kernels import layer_ops as ops
from pagedserve.kernels import reshape_and_cache, reshape_and_cache_ref


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.fixture(autouse=True)
def _built() -> None:
    assert cpu_kernels.cpu_ops() is not None, "the compiled CPU kernels did not build"


@pytest.mark.parametrize("t,h", [(1, 64), (37, 576), (130, 100)])
def test_rms_norm(t, h) -> None:
    g = torch.Generator().manual_seed(t)
    wide = torch.randn(t, 2 * h, generator=g) * 3
    x = wide[:, :h]  # a strided view
    w = torch.randn(h, generator=g)
    got = ops.rms_norm(x, w, 1e-6)
    assert got.shape == (t, h) and got.is_contiguous()
    assert _rel(got, ops.rms_norm_ref(x.double(), w.double(), 1e-6)) <= 1e-6
    # Not 2-D: the torch expression, bit for bit.
    x3 = torch.randn(t, 3, h, generator=g)
    assert torch.equal(ops.rms_norm(x3, w, 1e-6), ops.rms_norm_ref(x3, w, 1e-6))


@pytest.mark.parametrize("t,h", [(1, 64), (37, 576), (130, 100)])
def test_add_rms_norm_updates_the_residual_and_norms_the_sum(t, h) -> None:
    g = torch.Generator().manual_seed(t + h)
    residual = torch.randn(t, h, generator=g) * 2
    wide = torch.randn(t, 2 * h, generator=g)
    x = wide[:, h:]  # a strided view, as a sublayer's output may be
    w = torch.randn(h, generator=g)
    want_sum = residual + x  # the reference's out-of-place add, float32
    got = ops.add_rms_norm_(residual, x, w, 1e-6)
    assert torch.equal(residual, want_sum)  # the same float32 add, bit for bit
    assert got.shape == (t, h) and got.is_contiguous()
    assert _rel(got, ops.rms_norm_ref(want_sum.double(), w.double(), 1e-6)) <= 1e-6
    # The torch path (here float64) does the same: the add in place, then the norm.
    r64, x64 = want_sum.double().clone(), x.double()
    out64 = ops.add_rms_norm_(r64, x64, w.double(), 1e-6)
    assert torch.equal(r64, want_sum.double() + x64)
    assert torch.equal(out64, ops.rms_norm_ref(want_sum.double() + x64, w.double(), 1e-6))


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 1, 128)])
def test_rotary_equals_the_torch_expression(hq, hkv, d) -> None:
    g = torch.Generator().manual_seed(hq * d)
    t = 29
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    pos = torch.randint(0, 300, (t,), generator=g)
    ang = torch.randn(300, d // 2, generator=g) * 5
    got_q, got_k = ops.rotary(q, k, pos, ang.cos(), ang.sin())
    want_q, want_k = ops.rotary_ref(q, k, pos, ang.cos(), ang.sin())
    assert got_q.is_contiguous() and got_k.is_contiguous()
    # Same products and sums as the expression, no contraction: equal bit for bit.
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    ref_q, _ = ops.rotary_ref(q.double(), k.double(), pos, ang.cos().double(),
                              ang.sin().double())
    assert _rel(got_q, ref_q) <= 1e-6
    with pytest.raises(RuntimeError, match="outside the table"):
        ops.rotary(q, k, torch.full((t,), 300), ang.cos(), ang.sin())


def test_silu_and_mul() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(45, 2 * 1536, generator=g) * 6
    got = ops.silu_and_mul(x)
    assert got.shape == (45, 1536)
    assert _rel(got, ops.silu_and_mul_ref(x.double())) <= 1e-6


def _both_paths(v: torch.Tensor) -> torch.Tensor:
    """v's values as a row that the kernel's sixteen-lane loop (AVX-512 builds) and its
    element-by-element tail each see whole: v 16 times over, then v once (len(v) < 16)."""
    return torch.cat([v.repeat(16), v])


def test_silu_and_mul_far_out_is_right_element_by_element() -> None:
    """Gates where exp(-gate) nears float32's ends: each product to float64's within 1e-6 of
    itself, tiny ones included (an exp that overflowed early made those 0), and the ends
    and NaN as torch has them, in float32 and (the ends) bf16, through both of the kernel's
    loops."""
    gate = _both_paths(torch.tensor([-88.7, -88.5, -88.4, -87.0, -50.0, -1.0, 0.0, 3.0, 88.5,
                                     100.0, 500.0]))
    up = torch.full_like(gate, 1.5)
    got = ops.silu_and_mul(torch.cat([gate, up])[None])[0]
    want = ops.silu_and_mul_ref(torch.cat([gate, up]).double()[None])[0]
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=0.0)
    ends = _both_paths(torch.tensor([-1000.0, float("inf"), float("nan")]))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.cat([ends, torch.ones_like(ends)])[None].to(dtype)
        got, want = ops.silu_and_mul(x), ops.silu_and_mul_ref(x.double())
        assert torch.allclose(got.double(), want, equal_nan=True)


def test_cache_write_matches_the_reference() -> None:
    g = torch.Generator().manual_seed(5)
    t, hkv, d, bs, nb = 21, 2, 64, 8, 12
    kv = torch.randn(t, 3 * hkv * d, generator=g)
    key = kv[:, : hkv * d].view(t, hkv, d)  # views, as the layer passes them
    value = kv[:, hkv * d : 2 * hkv * d].view(t, hkv, d)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[[3, 10]] = -1  # another CP rank's tokens
    got, want = torch.zeros(nb, 2, bs, hkv, d), torch.zeros(nb, 2, bs, hkv, d)
    reshape_and_cache(key, value, got, slots.int())
    reshape_and_cache_ref(key, value, want, slots)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="outside a cache"):
        reshape_and_cache(key, value, got, torch.full((t,), nb * bs))
