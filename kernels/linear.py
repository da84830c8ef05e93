"""The linear layers' matmul, ``y = x W^T (+ b)``, with the weight packed once for the CPU.

Two packed layouts, chosen per weight when it is packed after loading:

- **tiled** (``csrc/linear_cpu.cpp``, where the build targets AVX-512 or AVX2 with FMA; bf16
  by AVX512-BF16's products or, on AVX2, weights widened to float32 as they are read): the
  weight in tiles of 32 output columns, each one contiguous stream (``tile_weight`` says how).
  At a decode step's few rows a matmul is a read of every weight, and this kernel streams it at
  close to the machine's read bandwidth where oneDNN's matmul reached about two thirds of it; at
  64 rows and more it is level with or ahead of oneDNN's (``benchmarks/scripts/cpu_kernels.py``
  measures both on the checkpoints' shapes). It needs ``N`` a multiple of 32 and, at bf16, ``K``
  even; real checkpoints' projections all are.
- **oneDNN** (``torch.ops.mkldnn``): the weight reordered once into oneDNN's blocked layout,
  where the tiled kernel is not built or the shape does not tile. ``F.linear`` on a plain float32
  weight calls MKL's sgemm, which re-reads the row-major weight on every call and parallelises
  poorly at few rows; oneDNN's bf16 matmul runs in hardware only with AVX512-BF16 or AMX (on an
  AVX2 host it refuses the bf16 reorder, "needs avx_ne_convert or avx512bw/vl/dq", and on
  AVX-512 without BF16 it would emulate, as ``F.linear``'s own bf16 path does), so a bf16 weight
  is packed only on such a CPU (``kernels.cpu_caps``).

Every path sums in float32 and rounds the result once to the input's dtype; they differ in
summation order only. A weight neither path takes keeps ``F.linear``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu import cpu_ops
from pagedserve.kernels.cpu_caps import has_native_bf16

__all__ = [
    "PACK_MIN_ELEMENTS",
    "TILE",
    "is_tiled",
    "linear",
    "linear_ref",
    "pack_weight",
    "packs",
    "tile_weight",
    "tileable",
    "tiles",
    "untile_weight",
]

TILE = 32  # output columns per tile of the tiled layout
# csrc/linear_cpu.cpp's mask of the weight dtypes it serves, and the k values per step of its K
# loop (a 64-byte vector holds 16 columns x this many k: vdpbf16ps takes k pairs, vpdpbusd
# quads)
_TILED_DTYPE_BITS = {torch.float32: 1, torch.bfloat16: 2, torch.int8: 4}
_K_PER_STEP = {torch.bfloat16: 2, torch.int8: 4}

# Below about this many weight elements (a 512 x 512 projection) oneDNN's fixed cost per call
# outweighs what the packed layout saves (the demo model's small projections are slower packed;
# ``benchmarks/scripts/cpu_kernels.py`` measures where the two cross). The layers keep their plain
# weight below it.
PACK_MIN_ELEMENTS = 1 << 18


@functools.cache
def _onednn_linear(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch has oneDNN's packed linear for ``dtype``, checked once on a tiny
    weight (exact in both dtypes: small integers)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(2, 3, dtype=dtype)
        y = torch.ops.mkldnn._linear_pointwise(
            torch.ones(1, 3, dtype=dtype), torch.ops.mkldnn._reorder_linear_weight(w, None),
            None, "none", [], "",
        )
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.equal(y, torch.full((1, 2), 3.0, dtype=dtype)))


@functools.cache
def tiles(dtype: torch.dtype) -> bool:
    """Whether the compiled tiled kernel serves ``dtype`` on this machine."""
    ops = cpu_ops()
    return ops is not None and bool(ops.linear_tiled_dtypes() & _TILED_DTYPE_BITS.get(dtype, 0))


def tile_weight(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> the tiled layout: ``[N/32, K/s, 32, s]`` with s = 2 at bf16 and 4 at int8
    (element ``[t, p, c, j]`` is ``W[32 t + c, s p + j]``), ``[N/32, K, 32]`` at float32."""
    n, k = weight.shape
    s = _K_PER_STEP.get(weight.dtype, 1)
    tiled = weight.reshape(n // TILE, TILE, k // s, s).permute(0, 2, 1, 3).contiguous()
    return tiled if s == 2 else tiled.squeeze(-1)


def untile_weight(tiled: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`tile_weight`: ``[N, K]``."""
    t4 = tiled if tiled.dim() == 4 else tiled.unsqueeze(-1)
    n_tiles, steps, _, s = t4.shape
    return t4.permute(0, 2, 1, 3).reshape(n_tiles * TILE, steps * s)


def is_tiled(packed: torch.Tensor) -> bool:
    """Whether a packed weight is in the tiled layout (oneDNN's packed weights are 2-D)."""
    return packed.dim() in (3, 4)


def tileable(weight: torch.Tensor) -> bool:
    """Whether the tiled kernel takes this ``[N, K]`` weight here."""
    n, k = weight.shape
    return (weight.device.type == "cpu" and n % TILE == 0
            and k % _K_PER_STEP.get(weight.dtype, 1) == 0 and tiles(weight.dtype))


def _onednn_packs(dtype: torch.dtype) -> bool:
    if dtype == torch.float32:
        return _onednn_linear(torch.float32)
    if dtype == torch.bfloat16:
        return has_native_bf16() and _onednn_linear(torch.bfloat16)
    return False


def packs(dtype: torch.dtype) -> bool:
    """Whether ``pack_weight`` packs CPU weights of ``dtype`` on this machine (in one layout or
    the other)."""
    return tiles(dtype) or _onednn_packs(dtype)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight ``[out, in]`` tiled, else in oneDNN's layout, or None where ``linear`` should
    keep the plain weight (not on the CPU, or a dtype neither path runs fast here: see
    :func:`packs`)."""
    if weight.device.type != "cpu":
        return None
    with torch.no_grad():
        if tileable(weight):
            return tile_weight(weight.detach())
        if _onednn_packs(weight.dtype):
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    return None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [..., in] -> [..., out], through ``packed`` when there is one, else ``weight``."""
    if packed is None:
        assert weight is not None
        return F.linear(x, weight, bias)
    if is_tiled(packed):
        y = cpu_ops().linear_tiled(x.reshape(-1, x.shape[-1]), packed, bias)
        return y.view(*x.shape[:-1], y.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The reference the packed path is tested against (float64 in the tests)."""
    return F.linear(x, weight, bias)
