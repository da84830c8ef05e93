"""The int8 (weight-only and dynamic) and int4 matmuls against float64, the compiled
activation quantization against its torch reference, and aten's int4 layout convention."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cpu import cpu_ops
from pagedserve.kernels.linear import tileable, tiles
from pagedserve.kernels.quant_linear import (
    GROUP_SIZE,
    WEIGHT_ONLY_ROWS,
    dequantize_int4_ref,
    dequantize_int32,
    dequantize_int32_ref,
    hadamard_block,
    hadamard_matrix,
    hadamard_rows,
    hadamard_rows_ref,
    int4_linear,
    int4_linear_ref,
    int8_dynamic_linear_ref,
    int8_linear,
    int8_linear_ref,
    pack_int4,
    quantize_int8,
    quantize_rows_int8,
    quantize_rows_int8_ref,
)

# bfloat16 activations and output (8 significant bits) against float64: a few 2**-8 of the
# output's scale, summed over K products in float32 inside the kernel.
BF16_REL = 2e-2


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.parametrize("rows", [1, WEIGHT_ONLY_ROWS])
@pytest.mark.parametrize("shape", [(96, 64), (130, 256)])
def test_int8_weight_only_matches_float64(rows, shape) -> None:
    g = torch.Generator().manual_seed(rows)
    n, k = shape
    w = torch.randn(n, k, generator=g)
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g)
    q = quantize_int8(w, dynamic=False)  # weight-only at every row count
    assert q.tiled is None
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (n, k)
    assert int(q.qweight.abs().max()) <= 127
    # the quantization itself: no weight further than half a step from the original
    step = q.scale.double()[:, None]
    assert ((q.dequantize() - w.double()).abs() <= step / 2 + 1e-12).all()
    want = int8_linear_ref(x.double(), q, b.double())
    got = int8_linear(x, q, b)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert _rel(got, want) <= BF16_REL
    exact = int8_linear(x, q, b, compute_dtype=torch.float32)
    assert _rel(exact, want) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, WEIGHT_ONLY_ROWS + 1, 64])
@pytest.mark.parametrize("shape", [(96, 64), (130, 256)])
def test_int8_dynamic_matches_float64(rows, shape, dtype) -> None:
    # The activations are quantized per row: at every row count where the weight is tiled
    # (96 x 64, with AVX512-VNNI), above WEIGHT_ONLY_ROWS otherwise. Against the float64 run of
    # that arithmetic only the output's rounding separates them (float32: the scales' products;
    # bf16: 2**-8 of the output); against the unquantized activations, the activation rounding
    # (half a step of amax / 127 per element, summed over K) stays under BF16_REL.
    g = torch.Generator().manual_seed(rows)
    n, k = shape
    q = quantize_int8(torch.randn(n, k, generator=g))
    assert (q.tiled is not None) == tileable(q.qweight)
    if q.tiled is None and rows <= WEIGHT_ONLY_ROWS:
        pytest.skip("an untiled weight is weight-only at this row count")
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    got = int8_linear(x, q, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert _rel(got, int8_dynamic_linear_ref(x, q, b)) <= (1e-6 if dtype == torch.float32
                                                            else 2 ** -7)
    assert _rel(got, int8_linear_ref(x.double(), q, b.double())) <= BF16_REL


@pytest.mark.skipif(cpu_ops() is None, reason="the compiled CPU kernels did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_row_quantization_equals_reference(dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 200, generator=g) * 3).to(dtype)
    x[0] = 0.0  # an all-zero row: scale from the smallest normal, codes 0
    x[1, :4] = torch.tensor([127.0, 0.5, -0.5, 1.5])  # amax 127: step 1, ties to even
    x[2, 7] = float(torch.finfo(dtype).max) / 2  # one outlier flattens its row to 0 and 127
    q, s = quantize_rows_int8(x)
    q_ref, s_ref = quantize_rows_int8_ref(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    assert q[1, :4].tolist() == [127, 0, 0, 2] and not q[0].any()
    assert int(q.abs().max()) <= 127
    acc = torch.randint(-2 ** 20, 2 ** 20, (9, 48), generator=g, dtype=torch.int32)
    cols = torch.rand(48, generator=g)
    for out in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_int32(acc, s, cols, out),
                           dequantize_int32_ref(acc, s, cols, out))


def test_hadamard_matrix_is_orthonormal_and_symmetric() -> None:
    for block in (1, 2, 8, 64):
        h = hadamard_matrix(block)
        assert torch.equal(h, h.t())
        assert torch.allclose(h @ h, torch.eye(block, dtype=torch.float64), atol=1e-12)
        assert torch.allclose(h.abs(), torch.full_like(h, block ** -0.5), rtol=0, atol=1e-15)
    assert [hadamard_block(k) for k in (1536, 576, 96, 40, 7)] == [64, 64, 32, 8, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block", "k"), [(1, 192), (2, 192), (16, 192), (64, 192), (32, 1536),
                                          (64, 1536)])
def test_compiled_hadamard_rows_follow_float64(block, k, dtype) -> None:
    # The fast transform's butterflies in float32 against one float64 matmul: float32
    # summation (log2(block) adds per element), then the output's rounding to dtype. The
    # shapes give runs of K / block = 3 to 192 floats, shorter and longer than a vector.
    g = torch.Generator().manual_seed(block)
    x = (torch.randn(7, k, generator=g) * 4).to(dtype)
    x[3] = 0.0
    x[3, 5] = 300.0  # a lone outlier: spread evenly over its group, the rest of the row zero
    want = hadamard_rows_ref(x.double(), block)
    got = hadamard_rows(x, block)
    assert got.dtype == dtype and got.shape == x.shape
    assert _rel(got, want) <= (1e-6 if dtype == torch.float32 else 2 ** -8)
    group = want[3, 5 % (k // block)::k // block]  # channels K / block apart
    assert torch.allclose(group.abs(), torch.full((block,), 300.0 / block ** 0.5,
                                                  dtype=torch.float64))
    assert want[3].count_nonzero() == block
    with pytest.raises((ValueError, RuntimeError), match="power of two"):
        hadamard_rows(x, 3)


@pytest.mark.parametrize("rows", [1, 64])
def test_int8_with_a_rotated_input_matches_float64(rows) -> None:
    # The codes hold W H and the kernels rotate x: the product is x W^T, whichever kernel the
    # row count picks, and dequantize() gives back W to within the rotated codes' rounding.
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 128, generator=g)
    w[:, 9] *= 30  # an input channel far larger than the rest
    q = quantize_int8(w, hadamard=32)
    assert q.hadamard == 32
    assert _rel(q.dequantize(), w) <= 2 ** -7
    x = torch.randn(rows, 128, generator=g)
    got = int8_linear(x, q)
    assert _rel(got, int8_linear_ref(x.double(), q)) <= BF16_REL
    assert _rel(got, x.double() @ w.double().t()) <= BF16_REL
    if rows > WEIGHT_ONLY_ROWS:
        assert _rel(got, int8_dynamic_linear_ref(x, q)) <= 1e-6


def test_int8_narrow_input_stays_weight_only() -> None:
    # _int_mm's sums are wrong at K = 1 in this torch, so narrow layers keep the weight-only
    # kernel at any row count.
    g = torch.Generator().manual_seed(1)
    q = quantize_int8(torch.randn(16, 1, generator=g))
    x = torch.randn(32, 1, generator=g)
    got = int8_linear(x, q, compute_dtype=torch.float32)
    assert _rel(got, int8_linear_ref(x.double(), q)) <= 1e-5


def test_int8_takes_leading_dims() -> None:
    g = torch.Generator().manual_seed(0)
    q = quantize_int8(torch.randn(32, 64, generator=g))
    x = torch.randn(2, 3, 64, generator=g)
    got = int8_linear(x, q)
    assert got.shape == (2, 3, 32)
    assert torch.equal(got, int8_linear(x.reshape(6, 64), q).reshape(2, 3, 32))


def _random_int4(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // GROUP_SIZE, generator=g) + 0.1
    zeros = torch.randn(n, k // GROUP_SIZE, generator=g)
    return codes, scales, zeros


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("shape", [(64, 64), (208, 320)])
def test_int4_convention_is_q_minus_8_times_scale_plus_zero(rows, shape) -> None:
    # float32 activations and scales run the kernel's exact path: only float32 summation
    # separates it from the float64 dequantization, so a wrong offset or sign cannot pass.
    g = torch.Generator().manual_seed(rows)
    codes, scales, zeros = _random_int4(*shape, g)
    x = torch.randn(rows, shape[1], generator=g)
    want = int4_linear_ref(x.double(), codes, scales, zeros)
    w = pack_int4(codes, scales, zeros, scale_dtype=torch.float32)
    got = int4_linear(x, w, compute_dtype=torch.float32)
    assert got.shape == (rows, shape[0]) and got.dtype == torch.float32
    assert _rel(got, want) <= 1e-5
    unsigned = torch.nn.functional.linear(x.double(), codes.double() * scales.double()
                                          .repeat_interleave(GROUP_SIZE, 1))
    assert _rel(got, unsigned) > 1e-2  # not q * s: the offset of 8 matters


@pytest.mark.parametrize("rows", [1, 33])
def test_int4_bfloat16_kernel_matches_float64(rows) -> None:
    g = torch.Generator().manual_seed(7 + rows)
    codes, scales, zeros = _random_int4(96, 128, g)
    x = torch.randn(rows, 128, generator=g)
    b = torch.randn(96, generator=g)
    got = int4_linear(x, pack_int4(codes, scales, zeros), b)
    want = int4_linear_ref(x.double(), codes, scales, zeros, b.double())
    assert got.dtype == torch.float32
    assert _rel(got, want) <= BF16_REL


def test_int4_dequantization_reference() -> None:
    codes = torch.tensor([[0, 8, 15] + [8] * 29], dtype=torch.uint8)
    w = dequantize_int4_ref(codes, torch.tensor([[0.5]]), torch.tensor([[1.0]]))
    assert w[0, :3].tolist() == [-3.0, 1.0, 4.5]


def test_int4_refuses_bad_shapes() -> None:
    codes = torch.zeros(16, 48, dtype=torch.uint8)
    with pytest.raises(ValueError, match="groups of 32"):
        pack_int4(codes, torch.ones(16, 1), torch.zeros(16, 1))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        big = torch.full((16, 32), 16, dtype=torch.uint8)
        pack_int4(big, torch.ones(16, 1), torch.zeros(16, 1))
    with pytest.raises(ValueError, match="divisible by 16"):
        pack_int4(torch.zeros(20, 32, dtype=torch.uint8), torch.ones(20, 1), torch.zeros(20, 1))


@pytest.mark.skipif(not tiles(torch.int8), reason="no tiled int8 kernel (needs AVX512-VNNI)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hadamard", [0, 32, 64])
def test_tiled_int8_equals_the_unfused_dynamic_path(dtype, hadamard) -> None:
    """The tiled kernel sums the same int8 products exactly and scales them in the same order
    as quantize_rows_int8, torch._int_mm and dequantize_int32: the same result bit for bit, at
    every row path of the kernel (one to four rows, blocks of eight, chunks of 64)."""
    g = torch.Generator().manual_seed(hadamard)
    w = torch.randn(96, 192, generator=g)
    q = quantize_int8(w, hadamard=hadamard)
    assert q.tiled is not None and q.plain is None
    assert torch.equal(q.offset, 128 * q.qweight.sum(dim=1, dtype=torch.int32))
    for rows in (1, 2, 3, 4, 5, 9, 64, 70):
        x = (torch.randn(rows, 192, generator=g) * 3).to(dtype)
        got = int8_linear(x, q)
        xr = hadamard_rows(x, hadamard) if hadamard else x
        codes, row_scale = quantize_rows_int8(xr)
        want = dequantize_int32(torch._int_mm(codes, q.qweight.t()), row_scale, q.col_scale, dtype)
        assert torch.equal(got, want), rows
        # float32 out (the LM head's logits): the epilogue's value before its rounding to dtype
        wide = int8_linear(x, q, out_dtype=torch.float32)
        assert wide.dtype == torch.float32
        assert torch.equal(wide, dequantize_int32(torch._int_mm(codes, q.qweight.t()),
                                                  row_scale, q.col_scale, torch.float32)), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [0, 64])
def test_ops_that_quantize_the_row_they_compute(dtype, block) -> None:
    """The norm and SiLU ops that hand an int8 projection its codes: each is its plain op
    followed by quantize_rows_uint8, bit for bit (codes and scales), and the codes through
    int8_linear_codes give int8_linear_tiled's result. quantize_rows_uint8 itself is
    quantize_rows_int8 (after the compiled rotation) plus 128."""
    ops = cpu_ops()
    g = torch.Generator().manual_seed(block)
    x = (torch.randn(9, 256, generator=g) * 3).to(dtype)
    x[4] = 0.0  # a zero row: scale FLT_MIN, every code 128
    rotated = hadamard_rows(x, block) if block else x
    codes, scale = ops.quantize_rows_uint8(x, block)
    want_codes, want_scale = quantize_rows_int8(rotated)
    assert codes.dtype == torch.uint8
    assert torch.equal(codes.int() - 128, want_codes.int()) and torch.equal(scale, want_scale)

    residual = (torch.randn(9, 256, generator=g) * 2).to(dtype)
    weight = (1 + 0.1 * torch.randn(256, generator=g)).to(dtype)
    r1, r2 = residual.clone(), residual.clone()
    normed = ops.add_rms_norm_(r1, x, weight, 1e-5)
    got = ops.add_rms_norm_quant_(r2, x, weight, 1e-5, block)
    assert torch.equal(r1, r2)
    want = ops.quantize_rows_uint8(normed, block)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    gate_up = (torch.randn(9, 512, generator=g) * 2).to(dtype)
    got = ops.silu_and_mul_quant(gate_up, block)
    want = ops.quantize_rows_uint8(ops.silu_and_mul(gate_up), block)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(RuntimeError, match="power of two"):
        ops.silu_and_mul_quant(gate_up, 3)
    with pytest.raises(RuntimeError, match="power of two"):
        ops.add_rms_norm_quant_(residual.clone(), x, weight, 1e-5, 3)
    with pytest.raises(RuntimeError, match=r"\[T, H\]"):
        ops.add_rms_norm_quant_(residual[:4].clone(), x, weight, 1e-5, block)

    if not tiles(torch.int8):
        return
    q = quantize_int8(torch.randn(64, 256, generator=g), hadamard=block)
    fused = ops.int8_linear_codes(codes, scale, q.tiled, q.offset, q.col_scale, None, dtype)
    assert torch.equal(fused, int8_linear(x, q))
    with pytest.raises(RuntimeError, match="uint8"):
        ops.int8_linear_codes(codes.to(torch.int8), scale, q.tiled, q.offset, q.col_scale, None,
                              dtype)
    with pytest.raises(RuntimeError, match="columns"):
        ops.int8_linear_codes(codes[:, :128].contiguous(), scale, q.tiled, q.offset, q.col_scale,
                              None, dtype)
