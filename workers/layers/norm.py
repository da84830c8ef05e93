"""RMSNorm, computed in float32 like the reference implementation (``kernels.layer_ops``)."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.layer_ops import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]; normalise in float32, scale in the input dtype.
        return rms_norm(x, self.weight, self.eps)
