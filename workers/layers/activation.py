"""Gated activations (``kernels.layer_ops``)."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.layer_ops import silu_and_mul


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` over a fused ``[gate | up]`` input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, 2 * I] -> [T, I]
        return silu_and_mul(x)
