"""Quantized matmuls, ``y = x W^T (+ b)`` with W held in int8 or int4.

Two layouts, each on CPU kernels with a pure-torch reference beside it:

- **int8 per output channel** (``quantize_int8``): ``W[n, k] = q[n, k] * s[n]``, q int8 in
  [-127, 127], s = max|W[n, :]| / 127. Where the build has AVX512-VNNI and the shape tiles,
  a weight that may take dynamic activations is held in the tiled layout of
  ``kernels.linear`` and runs ``csrc/linear_cpu.cpp``'s ``int8_linear_tiled`` at every row
  count: the dynamic path below fused into one call (the online rotation and the row
  quantization in one pass a row, vpdpbusd's exact int32 sums, the scales), its result the
  unfused path's bit for bit. The compiled decoder layer goes one step further: the norm or
  SiLU before such a projection quantizes the row it computes (``csrc/layers_cpu.cpp``'s
  ``*_quant`` ops) and the matmul takes the codes (``int8_linear_codes``). At one row it reads
  half of bf16's bytes, and at a batch it issues half of bf16's multiply-add instructions
  (vpdpbusd sums 64 products where vdpbf16ps sums 32;
  ``benchmarks/scripts/int8_linear.py`` measures both, ``docs/results/performance.md``
  section 18 has the figures). Elsewhere, two kernels, chosen by the number of
  rows:
  - up to ``WEIGHT_ONLY_ROWS`` rows (a decode step of a few sequences, where reading the
    weight is the cost), weight-only through ``aten._weight_int8pack_mm``;
  - above it, dynamic int8 activations: each row of x is quantized symmetrically with its own
    scale (``quantize_rows_int8``, compiled in ``csrc/quant_cpu.cpp``), the int8 product runs
    through ``torch._int_mm`` (int32 sums, exact), and ``dequantize_int32`` applies the row and
    channel scales. ``_weight_int8pack_mm`` computes one matrix-vector product per row, which
    falls behind a GEMM as rows grow (``benchmarks/scripts/int8_linear.py`` measures both per
    shape; the figures are in ``docs/results/quantization.md``).
    This is the scheme of torchao's ``int8_dynamic_activation_int8_weight``: the activation
    rounding (at most half a step of its row's amax / 127 per element) is the price, measured
    as perplexity in ``docs/results/quantization.md``. The caller says per weight whether it
    may take that path (``quantize_int8(..., dynamic=)``), and whether the weight's input
    columns are rotated first (``hadamard=``: a Hadamard rotation, undone by rotating x with a
    fast transform, ``hadamard_rows``, which spreads an activation outlier over many channels);
    ``workers/quantize.py`` says where each is used.
- **int4 in groups of 32 along the input dim** (``pack_int4``), the layout of GGUF's Q4_0 and
  Q4_1 blocks: ``W[n, k] = (q[n, k] - 8) * s[n, g] + z[n, g]`` with q in [0, 15] and
  ``g = k // 32``. That is aten's convention (``_weight_int4pack_mm_for_cpu``, weights packed
  by ``_convert_weight_to_int4pack_for_cpu``); ``tests/kernels/test_quant_linear.py`` checks
  it against float64. Q4_1 (``d * q + m``) is ``s = d, z = m + 8 d``; Q4_0 (``d * (q - 8)``)
  is ``s = d, z = 0``.

Casts: the two weight-only aten kernels take the activations and the scales in one dtype and
vectorise only bfloat16 (float32 runs a scalar loop, about 10x slower on an AVX2 machine), so
the activations are cast to bfloat16, the kernel accumulates in float32 and rounds its output
to bfloat16, and the result is cast back to the caller's dtype. The scales are rounded to
bfloat16 at quantization (a relative rounding of at most 2**-9 per scale) and the codes are
rounded against the rounded scale. ``compute_dtype=torch.float32`` runs the weight-only
kernels' exact path (tests use it to check the layout convention exactly). The dynamic path
writes the caller's dtype directly. All kernels are CPU ones: off the CPU, int8 takes the
reference (dequantize, then ``F.linear``) and the loader keeps GGUF weights dequantized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu import compiled_for, cpu_ops
from pagedserve.kernels.linear import tile_weight, tileable, untile_weight

__all__ = [
    "GROUP_SIZE",
    "Int4Weight",
    "Int8Weight",
    "WEIGHT_ONLY_ROWS",
    "dequantize_int32",
    "dequantize_int32_ref",
    "dequantize_int4_ref",
    "hadamard_block",
    "hadamard_matrix",
    "hadamard_rows",
    "hadamard_rows_ref",
    "int4_linear",
    "int4_linear_ref",
    "int8_linear",
    "int8_dynamic_linear_ref",
    "int8_linear_ref",
    "pack_int4",
    "quantize_int8",
    "quantize_rows_int8",
    "quantize_rows_int8_ref",
    "quantized_linear",
]

GROUP_SIZE = 32  # GGUF's Q4_0 / Q4_1 / Q8_0 block length
_KERNEL_DTYPE = torch.bfloat16
_INNER_K_TILES = 2  # the packing's K tiling; K must be a multiple of 16 * this
_N_MULTIPLE = 16  # the packing's N tiling (aten refuses other output sizes)
# Rows up to which int8 stays weight-only: at a few rows the weight read is the cost, and
# _weight_int8pack_mm reads half of bf16's bytes; from about eight rows its per-row products
# fall behind the int8 GEMM (benchmarks/scripts/int8_linear.py).
WEIGHT_ONLY_ROWS = 4
# _int_mm on the CPU returns wrong sums for K = 1 (torch 2.13); real layers are far wider.
INT_MM_MIN_K = 16


class Int8Weight:
    """An int8 weight ``[out, in]`` and its per-channel scale ``[out]`` in the kernel dtype,
    with the same scale in float32 for the dynamic path's epilogue (``col_scale``).
    ``dynamic`` False keeps the layer weight-only at every row count. ``hadamard`` > 0: the
    codes hold ``W R`` (R the orthonormal Hadamard rotation of ``hadamard_rows_ref`` over
    groups of that many input columns) and the kernels rotate x alike,
    ``(x R)(W R)^T = x W^T``, so that one row scale fits every element of a row
    (``quantize_int8``).

    A dynamic weight the tiled kernel takes (``kernels.linear.tileable``: AVX512-VNNI, 32 | out,
    4 | in) is held only tiled (``tiled``, with ``offset`` = 128 x each column's code sum, the
    kernel's correction for its unsigned activations) and runs dynamic at every row count;
    ``qweight`` then rebuilds the plain codes on request (tests, references)."""

    __slots__ = ("col_scale", "dynamic", "hadamard", "offset", "plain", "scale", "tiled")

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, dynamic: bool = True,
                 hadamard: int = 0) -> None:
        self.scale = scale
        self.col_scale = scale.float().contiguous()
        self.dynamic = dynamic
        self.hadamard = hadamard
        self.tiled = tile_weight(qweight) if dynamic and tileable(qweight) else None
        self.offset = (128 * qweight.sum(dim=1, dtype=torch.int32)
                       if self.tiled is not None else None)
        self.plain = None if self.tiled is not None else qweight

    @property
    def qweight(self) -> torch.Tensor:
        """The codes ``[out, in]`` int8."""
        return self.plain if self.plain is not None else untile_weight(self.tiled)

    @property
    def nbytes(self) -> int:
        held = (self.plain,) if self.tiled is None else (self.tiled, self.offset)
        return sum(t.nbytes for t in held) + self.scale.nbytes + self.col_scale.nbytes

    def dequantize(self) -> torch.Tensor:
        """The weight the layer computes with [out, in], float64 (the rotation turned back)."""
        w = self.qweight.double() * self.scale.double()[:, None]
        return hadamard_rows_ref(w, self.hadamard) if self.hadamard else w


def hadamard_block(k: int, cap: int = 64) -> int:
    """The largest power of two that divides ``k``, at most ``cap``."""
    return min(k & -k, cap) if k > 0 else 0


def hadamard_matrix(block: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix of order ``block`` (a power of two) over sqrt(block):
    orthonormal and symmetric, ``H[i, j] = (-1)^popcount(i & j) / sqrt(block)``, float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / block**0.5


def hadamard_rows_ref(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., K] -> each row seen as [block, K / block], times ``hadamard_matrix(block)`` from
    the left: every group of ``block`` channels K / block apart rotated (``R = H ⊗ I``,
    symmetric and orthonormal, so ``x R`` is undone by rotating again). In x's dtype, float32
    arithmetic for lower precisions."""
    k = x.shape[-1]
    if block < 1 or block & (block - 1) or k % block:
        raise ValueError(f"the Hadamard block must be a power of two dividing {k}, got {block}")
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = hadamard_matrix(block).to(ct)
    y = h @ x.to(ct).reshape(-1, block, k // block)
    return y.reshape(x.shape).to(x.dtype)


def hadamard_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """``hadamard_rows_ref`` through the compiled fast Walsh-Hadamard transform where it
    serves x [T, K] (log2(block) butterfly passes instead of a matmul)."""
    if x.dim() == 2 and x.stride(-1) == 1 and compiled_for(x):
        return cpu_ops().hadamard_rows(x, block)
    return hadamard_rows_ref(x, block)


def quantize_int8(
    weight: torch.Tensor, scale_dtype: torch.dtype = _KERNEL_DTYPE, dynamic: bool = True,
    hadamard: int = 0,
) -> Int8Weight:
    """Symmetric per-output-channel int8: ``weight [out, in]`` -> ``q * s``, q in [-127, 127];
    ``dynamic``: whether batched rows may take the dynamic int8 activations; ``hadamard`` > 0:
    quantize ``W R`` instead, R the Hadamard rotation of ``hadamard_rows_ref`` over groups of
    that many input columns, which the kernels undo by rotating x (``Int8Weight``). A rotation
    spreads an input channel that runs far larger than the rest over its whole group, so one
    scale per activation row loses less of the other elements.

    The codes are rounded against the scale as stored (``scale_dtype``), so the bfloat16
    rounding of a scale moves no weight by more than half a step."""
    w = weight.detach()
    # the rotation in float64 (a weight-sized copy only where there is one to compute)
    w = hadamard_rows_ref(w.double(), hadamard).float() if hadamard else w.float()
    amax = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    scale = (amax / 127.0).to(scale_dtype)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous(), dynamic, hadamard)


def quantize_rows_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q [T, K] int8, scale [T] float32): each row symmetric, scale = amax / 127
    (at least float32's smallest normal, so that a zero row's reciprocal stays finite)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    inv = 1.0 / scale
    q = torch.round(xf * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_int8_ref`` in one compiled pass where the library serves ``x``."""
    if x.dim() == 2 and x.stride(-1) == 1 and compiled_for(x):
        return cpu_ops().quantize_rows_int8(x)
    return quantize_rows_int8_ref(x)


def dequantize_int32_ref(
    acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """acc [T, N] int32 -> ``(acc * row_scale[:, None]) * col_scale`` in ``dtype``."""
    return (acc.float() * row_scale[:, None] * col_scale).to(dtype)


def dequantize_int32(
    acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``dequantize_int32_ref`` in one compiled pass where the library serves it."""
    if dtype in (torch.float32, torch.bfloat16) and compiled_for(row_scale, col_scale):
        return cpu_ops().dequantize_int32(acc.contiguous(), row_scale, col_scale, dtype)
    return dequantize_int32_ref(acc, row_scale, col_scale, dtype)


def int8_linear(
    x: torch.Tensor,
    weight: Int8Weight,
    bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype = _KERNEL_DTYPE,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x: [..., in] -> [..., out] in ``out_dtype`` (default x's): a tiled weight dynamic at
    every row count (``Int8Weight``); otherwise weight-only up to ``WEIGHT_ONLY_ROWS`` rows (or
    always, for a weight made with ``dynamic=False``), dynamic int8 activations above (the
    module docstring says why; ``compute_dtype`` is the weight-only kernel's). The tiled
    kernel's epilogue writes ``out_dtype`` itself (the LM head's float32 logits: no bf16
    rounding, no widening pass); the other paths convert."""
    out_dtype = out_dtype or x.dtype
    if x.device.type != "cpu":
        return int8_linear_ref(x, weight, bias).to(out_dtype)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if weight.tiled is not None and x.dtype in (torch.float32, torch.bfloat16):
        # the rotation, the row quantization and the matmul in one call
        y = cpu_ops().int8_linear_tiled(x2, weight.tiled, weight.offset, weight.col_scale,
                                        None if bias is None else bias.to(out_dtype).contiguous(),
                                        weight.hadamard, out_dtype)
        return y.view(*lead, -1)
    if weight.hadamard:
        x2 = hadamard_rows(x2, weight.hadamard)
    if x2.shape[0] <= WEIGHT_ONLY_ROWS or not weight.dynamic or k < INT_MM_MIN_K:
        y = torch.ops.aten._weight_int8pack_mm(x2.to(compute_dtype), weight.qweight,
                                               weight.scale.to(compute_dtype)).to(x.dtype)
    else:
        q, row_scale = quantize_rows_int8(x2)
        acc = torch._int_mm(q, weight.qweight.t())  # [T, out] int32
        y = dequantize_int32(acc, row_scale, weight.col_scale, x.dtype)
    y = y.view(*lead, -1)
    return (y if bias is None else y + bias).to(out_dtype)


def int8_linear_ref(
    x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The dequantized weight through ``F.linear`` in x's dtype (float64 in the tests)."""
    w = weight.dequantize().to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def int8_dynamic_linear_ref(
    x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The dynamic path's arithmetic in float64: x [T, in] (rotated as the weight is) quantized
    per row, the int8 product summed exactly, both scales applied."""
    q, row_scale = quantize_rows_int8_ref(
        hadamard_rows_ref(x, weight.hadamard) if weight.hadamard else x)
    acc = q.double() @ weight.qweight.double().t()
    y = acc * row_scale.double()[:, None] * weight.col_scale.double()
    return y if bias is None else y + bias.double()


class Int4Weight:
    """An int4 weight packed for the CPU kernel: ``packed`` [out, in / 2] uint8 and
    ``scale_zeros`` [in / 32, out, 2] (scale, zero) in the kernel dtype; ``out`` x ``in``."""

    __slots__ = ("in_features", "out_features", "packed", "scale_zeros")

    def __init__(self, packed: torch.Tensor, scale_zeros: torch.Tensor, out: int, inp: int) -> None:
        self.packed = packed
        self.scale_zeros = scale_zeros
        self.out_features = out
        self.in_features = inp

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_zeros.nbytes


def pack_int4(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    scale_dtype: torch.dtype = _KERNEL_DTYPE,
) -> Int4Weight:
    """codes [out, in] in [0, 15], scales and zeros [out, in / 32]: ``W = (q - 8) s + z``."""
    n, k = codes.shape
    if k % GROUP_SIZE or k % (16 * _INNER_K_TILES) or scales.shape != (n, k // GROUP_SIZE):
        raise ValueError(
            f"int4 groups of {GROUP_SIZE}: codes {tuple(codes.shape)} need scales "
            f"[{n}, {k // GROUP_SIZE}] and an input size divisible by {GROUP_SIZE}, "
            f"got scales {tuple(scales.shape)}"
        )
    if n % _N_MULTIPLE:
        raise ValueError(
            f"the int4 kernel needs an output size divisible by {_N_MULTIPLE}; got {n}"
        )
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("int4 codes must lie in [0, 15]")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        codes.to(torch.int32).contiguous(), _INNER_K_TILES
    )
    # [out, groups] x 2 -> [groups, out, 2], the kernel's layout
    sz = torch.stack([scales.float(), zeros.float()], dim=-1).transpose(0, 1)
    return Int4Weight(packed, sz.to(scale_dtype).contiguous(), n, k)


def dequantize_int4_ref(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    """``(q - 8) s + z`` in float64: codes [out, in], scales and zeros [out, in / 32]."""
    s = scales.double().repeat_interleave(GROUP_SIZE, dim=1)
    z = zeros.double().repeat_interleave(GROUP_SIZE, dim=1)
    return (codes.double() - 8.0) * s + z


def int4_linear(
    x: torch.Tensor,
    weight: Int4Weight,
    bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype = _KERNEL_DTYPE,
) -> torch.Tensor:
    """x: [..., in] -> [..., out] in x's dtype (see the module docstring for the casts)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).to(compute_dtype)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x2, weight.packed, GROUP_SIZE, weight.scale_zeros.to(compute_dtype)
    )
    y = y.to(x.dtype).view(*lead, -1)
    return y if bias is None else y + bias


def int4_linear_ref(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: the dequantized weight through ``F.linear`` in x's dtype."""
    w = dequantize_int4_ref(codes, scales, zeros).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def quantized_linear(
    x: torch.Tensor,
    weight: Int8Weight | Int4Weight,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x: [..., in] -> [..., out] in ``out_dtype`` (default x's) through the kernel of
    ``weight``'s layout."""
    if isinstance(weight, Int8Weight):
        return int8_linear(x, weight, bias, out_dtype=out_dtype)
    return int4_linear(x, weight, bias).to(out_dtype or x.dtype)
