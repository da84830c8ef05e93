"""A decoder layer's pointwise ops: RMSNorm (alone or after the residual add), rotary
embedding, SiLU-and-mul.

Each is a torch expression (``*_ref``, any device and dtype; the semantics) and, for float32 or
bfloat16 on CPU once the compiled library is built (``kernels.cpu``), one pass of
``csrc/layers_cpu.cpp`` in place of the expression's 4-8 operator launches (bf16 math in float32
there, rounded once per result). CUDA keeps the torch expressions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu import compiled_for, cpu_ops


def _one_dtype(*tensors: torch.Tensor) -> bool:
    return len({t.dtype for t in tensors}) == 1


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., H]; normalise in float32, scale in the input dtype (as Hugging Face does).
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim of ``x`` [..., H]."""
    if x.dim() == 2 and x.stride(-1) == 1 and _one_dtype(x, weight) and compiled_for(x, weight):
        return cpu_ops().rms_norm(x, weight, float(eps))
    return rms_norm_ref(x, weight, eps)


def add_rms_norm_ref(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    # residual, x: [T, H]; the residual stream becomes residual + x (in place), then is normed.
    residual.add_(x)
    return rms_norm_ref(residual, weight, eps)


def add_rms_norm_(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` in place, then ``rms_norm(residual)``: a decoder layer's residual add
    and the norm after it, in one pass over the rows where the compiled kernel serves."""
    if (x.dim() == 2 and x.stride(-1) == 1 and residual.stride(-1) == 1
            and _one_dtype(residual, x, weight) and compiled_for(residual, x, weight)):
        return cpu_ops().add_rms_norm_(residual, x, weight, float(eps))
    return add_rms_norm_ref(residual, x, weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_ref(
    q: torch.Tensor,  # [T, H_q, D]
    k: torch.Tensor,  # [T, H_kv, D]
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, D/2] float32
    sin: torch.Tensor,  # [P, D/2] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    c = cos[positions].unsqueeze(1)  # [T, 1, D/2]
    s = sin[positions].unsqueeze(1)
    return _rotate(q, c, s), _rotate(k, c, s)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-rotation RoPE of q [T, H_q, D] and k [T, H_kv, D] at ``positions``; the results are
    contiguous (the inputs may be views of a fused projection)."""
    # cos, sin stay float32 under a bf16 model: the kernel rotates in float32.
    if (q.stride(-1) == 1 and k.stride(-1) == 1 and positions.dtype == torch.int64
            and _one_dtype(q, k) and _one_dtype(cos, sin) and cos.dtype == torch.float32
            and compiled_for(q, k, cos, sin)):
        return cpu_ops().rotary(q, k, positions.contiguous(), cos, sin)
    return rotary_ref(q, k, positions, cos, sin)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over a fused ``[gate | up]`` input [T, 2I] -> [T, I]."""
    if x.dim() == 2 and x.stride(-1) == 1 and compiled_for(x):
        return cpu_ops().silu_and_mul(x)
    return silu_and_mul_ref(x)
