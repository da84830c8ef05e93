"""merge_attn_states: combine partial attention results by their log-sum-exps."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels._checks import TRITON_FLOAT_DTYPES, check_merge


@triton.jit
def _merge_attn_states_kernel(
    outs_ptr,  # [N, T, H, D], float
    lses_ptr,  # [N, T, H], float32
    out_ptr,  # [T, H, D], float
    out_lse_ptr,  # [T, H], float32
    num_shards,
    stride_on,
    stride_ot,
    stride_oh,
    stride_ln,
    stride_lt,
    stride_lh,
    stride_rt,
    stride_rh,
    stride_rlt,
    stride_rlh,
    HEAD_DIM: tl.constexpr,
    SHARDS_PAD: tl.constexpr,  # next power of two >= N
    BLOCK_D: tl.constexpr,  # next power of two >= D
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    n = tl.arange(0, SHARDS_PAD).to(tl.int64)  # [N_pad]; int64: split scratch can be large
    d = tl.arange(0, BLOCK_D)  # [D_pad]
    n_ok = n < num_shards
    lse = tl.load(lses_ptr + n * stride_ln + tok * stride_lt + head * stride_lh, mask=n_ok,
                  other=float("-inf")).to(tl.float32)
    # NaN and +inf mark empty shards (some backends report +inf for zero keys).
    lse = tl.where((lse != lse) | (lse == float("inf")), float("-inf"), lse)
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # [N_pad]; 0 for empty shards
    total = tl.sum(w, axis=0)
    live = w > 0
    o = tl.load(outs_ptr + n[:, None] * stride_on + tok * stride_ot + head * stride_oh + d[None, :],
                mask=live[:, None] & (d[None, :] < HEAD_DIM), other=0.0).to(tl.float32)
    acc = tl.sum(w[:, None] * o, axis=0)  # [D_pad]
    total_safe = tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + tok * stride_rt + head * stride_rh + d,
             (acc / total_safe).to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
    merged = tl.where(total > 0, m_safe + tl.log(total_safe), float("-inf"))
    tl.store(out_lse_ptr + tok * stride_rlt + head * stride_rlh, merged)


def merge_into(
    outputs: torch.Tensor,  # [N, T, H, D], float
    lses: torch.Tensor,  # [N, T, H], float32
    out: torch.Tensor,  # [T, H, D], written (unit stride in D)
    out_lse: torch.Tensor,  # [T, H], float32, written
) -> None:
    """Launches the merge into caller-provided buffers (used by the split-KV attention path)."""
    n, t, h, d = outputs.shape
    if t == 0 or h == 0:
        return
    if outputs.stride(-1) != 1:
        outputs = outputs.contiguous()
    _merge_attn_states_kernel[(t, h)](
        outputs, lses, out, out_lse, n,
        outputs.stride(0), outputs.stride(1), outputs.stride(2),
        lses.stride(0), lses.stride(1), lses.stride(2),
        out.stride(0), out.stride(1), out_lse.stride(0), out_lse.stride(1),
        HEAD_DIM=d, SHARDS_PAD=triton.next_power_of_2(n), BLOCK_D=triton.next_power_of_2(d),
    )


def merge_attn_states(
    outputs: torch.Tensor,  # [N, T, H, D], each shard's normalised output
    lses: torch.Tensor,  # [N, T, H], float32, natural-log LSE of each shard
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`pagedserve.kernels.reference.merge_attn_states_ref`."""
    check_merge(outputs, lses, TRITON_FLOAT_DTYPES)
    _, t, h, d = outputs.shape
    out = torch.empty((t, h, d), dtype=outputs.dtype, device=outputs.device)
    out_lse = torch.empty((t, h), dtype=torch.float32, device=outputs.device)
    merge_into(outputs, lses, out, out_lse)
    return out, out_lse
