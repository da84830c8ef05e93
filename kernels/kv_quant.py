"""KV-cache storage dtypes narrower than the model's: bfloat16 and scaled float8 (e4m3).

A cache of such a dtype holds ``x / scale`` rounded to it (fp8 saturates at +-448 instead of
overflowing to NaN, as vLLM's ``scaled_fp8_quant`` does); a read gives ``stored * scale`` in
the reader's dtype. ``scale`` is one float per layer for K and one for V (``k_scale``,
``v_scale``); 1.0 for bfloat16, whose range is float32's.
"""

from __future__ import annotations

import torch

FP8_E4M3 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_E4M3).max)  # 448
# Dtypes a cache may have when it differs from the activations' dtype: the write casts to them
# and the read widens from them. Any other cache dtype must equal the activations'.
KV_STORAGE_DTYPES = (torch.bfloat16, FP8_E4M3)
# The amax of the first prefill maps to FP8_MAX / KV_SCALE_HEADROOM, so later tokens up to
# twice as large still fit before saturating (vLLM divides the amax by 200 for K: 2.2x).
KV_SCALE_HEADROOM = 2.0


def needs_scale(cache_dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype is scaled (only fp8: bf16 has float32's range)."""
    return cache_dtype == FP8_E4M3


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as the cache stores it: ``x / scale`` in ``cache_dtype``, saturated for fp8."""
    if cache_dtype == x.dtype and scale == 1.0:
        return x
    y = x.float()
    if scale != 1.0:
        y = y / scale
    if cache_dtype == FP8_E4M3:
        y = y.clamp(-FP8_MAX, FP8_MAX)
    return y.to(cache_dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """What a stored ``x`` reads as in ``dtype``: ``x * scale``."""
    y = x.to(dtype)
    if scale == 1.0:
        return y
    return y * scale if y is x else y.mul_(scale)  # never scale the caller's tensor in place


def scale_from_amax(amax: float) -> float:
    """The fp8 scale for values whose largest magnitude is ``amax`` (1.0 for an all-zero
    tensor, so a layer that saw nothing keeps the identity)."""
    if not 0.0 < amax < float("inf"):  # 0, inf or NaN
        return 1.0
    # Rounded to float32, the precision the kernels divide and multiply by.
    return float(torch.tensor(amax * KV_SCALE_HEADROOM / FP8_MAX, dtype=torch.float32))
