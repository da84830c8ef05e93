"""The linear layers' matmul, ``y = x W^T (+ b)``, with the weight packed once for the CPU.

``F.linear`` on a CPU float32 weight calls MKL's sgemm, which re-reads the weight in its plain
row-major layout on every call and parallelises poorly when few rows come in (a decode step),
while oneDNN's matmul reads a weight reordered once into its blocked layout; the LM head, the
widest weight, gains most (``benchmarks/scripts/cpu_kernels.py`` measures both on the checkpoints'
shapes). So ``pack_weight`` reorders a weight after loading, when that path exists (CPU,
float32, a torch built with oneDNN), and ``linear`` runs the packed weight through oneDNN;
everywhere else the plain weight keeps ``F.linear``. Both sum in float32; they differ in
summation order only.

A bfloat16 weight is packed only on a CPU with bf16 instructions (AVX512-BF16 or AMX,
``kernels.cpu_caps``), where oneDNN's bf16 matmul runs in hardware on the packed layout. Without
them oneDNN refuses the bf16 reorder outright on an AVX2 host ("needs avx_ne_convert or
avx512bw/vl/dq", measured with this torch), and on AVX-512 without BF16 it would emulate, as
``F.linear``'s own bf16 path does: those keep ``F.linear``. Both accumulate in float32 and
round the result to bf16 once.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_caps import has_native_bf16

__all__ = ["PACK_MIN_ELEMENTS", "linear", "linear_ref", "pack_weight", "packs"]

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


def packs(dtype: torch.dtype) -> bool:
    """Whether ``pack_weight`` packs CPU weights of ``dtype`` on this machine."""
    if dtype == torch.float32:
        return _onednn_linear(torch.float32)
    if dtype == torch.bfloat16:
        return has_native_bf16() and _onednn_linear(torch.bfloat16)
    return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight ``[out, in]`` in oneDNN's layout, or None where ``linear`` should keep the
    plain weight (not on the CPU, no oneDNN, or a dtype it does not run fast here: see
    :func:`packs`)."""
    if weight.device.type != "cpu" or not packs(weight.dtype):
        return None
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


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
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The reference the packed path is tested against (float64 in the tests)."""
    return F.linear(x, weight, bias)
