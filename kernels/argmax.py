"""The index of each row's largest value: the sampler's greedy pick and its exponential race.

``argmax_ref`` is torch's ``argmax(-1)`` and the semantics: the first index of the maximum, a
NaN above every number. ``argmax`` takes ``csrc/argmax_cpu.cpp`` for float32 rows on the CPU
once the compiled library is built: torch's own CPU argmax carries its index through a
reduction that is not vectorised, and over a decode step's logits it costs many times the
pass over their bytes.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu import compiled_for, cpu_ops


def argmax_ref(x: torch.Tensor) -> torch.Tensor:
    # x: [N, V] -> [N] int64
    return x.argmax(-1)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x: [N, V] -> [N] int64, the first index of each row's maximum (``argmax_ref``)."""
    if (x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] > 0 and x.stride(1) == 1
            and compiled_for(x)):
        return cpu_ops().argmax_rows(x)
    return argmax_ref(x)
