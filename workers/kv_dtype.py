"""The KV cache's dtype: ``cache.kv_cache_dtype`` resolved against the model's dtype.

``auto`` keeps the model's; ``bfloat16`` halves a float32 model's KV bytes; ``fp8_e4m3``
(``torch.float8_e4m3fn``, scaled) quarters them. The kernels quantize on write and widen on
read (``kernels.kv_quant``).
"""

from __future__ import annotations

import logging

import torch

from pagedserve.config import ConfigError
from pagedserve.kernels.cpu import cpu_ops

log = logging.getLogger(__name__)

_BY_NAME = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV tensors for the configured name."""
    if name == "auto":
        return model_dtype
    if name not in _BY_NAME:
        raise ConfigError("kv_cache_dtype", f"must be one of auto, {', '.join(_BY_NAME)}; "
                                            f"got {name!r}")
    return _BY_NAME[name]


def log_kv_cache_dtype(kv_dtype: torch.dtype, model_dtype: torch.dtype,
                       device: torch.device) -> None:
    """Say which dtype the cache holds, and which attention path that takes on this device."""
    size = torch.empty((), dtype=kv_dtype).element_size()
    if kv_dtype == model_dtype:
        log.info("KV cache dtype %s (the model's, %d bytes per element)", kv_dtype, size)
        return
    if device.type != "cpu":
        kernels = "the Triton kernels"
    elif cpu_ops() is not None:
        kernels = "the compiled CPU kernels"
    else:  # no compiler here: every op takes its reference
        kernels = "the torch reference"
    path = f"{kernels} quantize on write and widen on read"
    log.info("KV cache dtype %s (%d bytes per element) under a %s model: %s",
             kv_dtype, size, model_dtype, path)
