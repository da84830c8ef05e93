"""RMSNorm, computed in float32 like the reference implementation (``kernels.layer_ops``)."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.layer_ops import add_rms_norm_, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # x: [..., dim]; normalise in float32, scale in the input dtype. With ``residual``
        # [T, dim]: the residual stream takes x first (``residual += x``, in place) and the
        # sum is normalised, the add of the reference's ``residual + x`` fused into this pass.
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm_(residual, x, self.weight, self.eps)
