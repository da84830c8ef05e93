"""paged_attention: one unified varlen kernel for mixed prefill, chunked prefill and decode.

Grid ``(query tile, kv head, kv split)``. A query tile is ``BLOCK_Q`` consecutive new tokens of
one sequence times the ``GROUP`` query heads that share the program's kv head, so each KV tile is
loaded once per kv head and reused by the whole group (the decode-friendly layout). The KV range
is walked ``TILE_N`` keys at a time through the block table with an online softmax in base 2.

Keys are addressed by *local* index ``j`` (offset ``j % B`` of block ``block_table[j // B]``);
under decode context parallelism the global position of ``j`` follows ``cp_layout``, which is
monotone in ``j``, so causal/window bounds prune to a contiguous ``[j_lo, j_hi)`` range.

With ``NUM_SPLITS > 1`` (decode batches too small to fill the GPU) every split writes a float32
partial result and its LSE to scratch, and ``merge.merge_into`` combines them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedserve.kernels._checks import (
    TRITON_KV_CACHE_DTYPES,
    check_kv_scales,
    check_paged_attention,
    check_triton_head_dim,
)
from pagedserve.kernels.cp_layout import NO_CP, CPLayout
from pagedserve.kernels.errors import KernelArgumentError
from pagedserve.kernels.merge import merge_into

_LOG2E = 1.4426950408889634


@triton.jit
def _local_len(n, CP_RANK, CP_SIZE, CP_INTERLEAVE):
    """How many of global positions [0, n) this rank stores (cp_layout.cp_local_seq_len)."""
    full = (n // (CP_INTERLEAVE * CP_SIZE)) * CP_INTERLEAVE
    rem = n - full * CP_SIZE - CP_RANK * CP_INTERLEAVE
    rem = tl.minimum(tl.maximum(rem, 0), CP_INTERLEAVE)
    return full + rem


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T_q, H_q, D], float
    kv_ptr,  # [num_blocks, 2, B, H_kv, D], float or fp8 (read as stored * scale), contiguous
    out_ptr,  # [T_q, H_q, D] (one split) or [NUM_SPLITS, T_q, H_q, D] float32 scratch
    lse_ptr,  # [T_q, H_q] or [NUM_SPLITS, T_q, H_q], float32, natural log
    cu_seqlens_ptr,  # [num_seqs + 1], int32
    seq_lens_ptr,  # [num_seqs], int32
    block_table_ptr,  # [num_seqs, max_blocks], int32
    num_seqs,
    scale_log2,  # softmax_scale * log2(e)
    k_scale,  # float: a key reads as stored * k_scale (DEQUANT only)
    v_scale,
    window,  # sliding window in tokens (ignored unless HAS_WINDOW)
    cp_rank,
    cp_size,
    cp_interleave,
    stride_qt,
    stride_qh,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    stride_lh,
    stride_bt,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # H_q // H_kv
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP
    BLOCK_Q: tl.constexpr,  # new tokens per program
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # kernel block size B
    TILE_N: tl.constexpr,  # keys per inner iteration
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DEQUANT: tl.constexpr,  # the cache's dtype or scales differ from q's: widen on load
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tl.static_assert(BLOCK_M >= 16, "tl.dot needs at least 16 rows")
    tl.static_assert(TILE_N >= 16, "tl.dot needs at least 16 keys per tile")
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Sequence s owns programs [cu[s] // BLOCK_Q + s, cu[s+1] // BLOCK_Q + s + 1), which covers
    # its cdiv(q_len, BLOCK_Q) tiles; find the last s whose first program is <= pid.
    lo: tl.int32 = 0  # typed so the loop-carried value is a tensor, not a constexpr
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_seqlens_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    q_begin = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_begin
    q_start = (pid - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q_start < q_len:
        ctx = tl.load(seq_lens_ptr + seq) - q_len  # global position of the first new token

        rows = tl.arange(0, BLOCK_M)  # row r = (query q_start + r // GROUP_PAD, head r % GROUP_PAD)
        q_idx = q_start + rows // GROUP_PAD  # [BLOCK_M]
        head = kv_head * GROUP + rows % GROUP_PAD  # [BLOCK_M]
        row_ok = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
        q_pos = ctx + q_idx  # [BLOCK_M] global positions
        dims = tl.arange(0, HEAD_DIM)
        tok = (q_begin + q_idx).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]

        # Local key range the tile can see.
        last = ctx + tl.minimum(q_start + BLOCK_Q, q_len)  # exclusive bound on global positions
        j_hi = _local_len(last, cp_rank, cp_size, cp_interleave)
        j_lo = 0
        if HAS_WINDOW:
            first = tl.maximum(ctx + q_start - window + 1, 0)
            j_lo = _local_len(first, cp_rank, cp_size, cp_interleave)
        n_tiles = tl.cdiv(j_hi - j_lo, TILE_N)
        per_split = tl.cdiv(n_tiles, NUM_SPLITS)
        t_begin = split * per_split
        t_end = tl.minimum(t_begin + per_split, n_tiles)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        TOKEN_NUMEL: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
        bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
        for t in range(t_begin, t_end):
            j = j_lo + t * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] local key indices
            k_ok = j < j_hi
            blk = tl.load(bt_row + j // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            off = j % BLOCK_SIZE
            base = blk * (2 * BLOCK_SIZE * TOKEN_NUMEL) + off * TOKEN_NUMEL + kv_head * HEAD_DIM
            k = tl.load(kv_ptr + base[:, None] + dims[None, :], mask=k_ok[:, None], other=0.0)
            v = tl.load(kv_ptr + base[:, None] + BLOCK_SIZE * TOKEN_NUMEL + dims[None, :],
                        mask=k_ok[:, None], other=0.0)  # [TILE_N, D]
            if DEQUANT:  # as vLLM's Triton attention: scale in float32, then q's dtype
                k = (k.to(tl.float32) * k_scale).to(q.dtype)
                v = (v.to(tl.float32) * v_scale).to(q.dtype)
            # Global position of each local key (cp_layout.cp_global_position).
            local = j % BLOCK_SIZE
            key_pos = ((j // BLOCK_SIZE) * (BLOCK_SIZE * cp_size)
                       + (local // cp_interleave) * (cp_size * cp_interleave)
                       + cp_rank * cp_interleave + local % cp_interleave)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            visible = k_ok[None, :] & (key_pos[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (key_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))  # [BLOCK_M, TILE_N]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row that has seen nothing yet keeps max -inf; shift by 0 so exp2 gives 0, not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        seen = l_i > 0
        l_safe = tl.where(seen, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        split_off = split.to(tl.int64)
        o_ptrs = (out_ptr + split_off * stride_os + tok[:, None] * stride_ot
                  + head[:, None] * stride_oh + dims[None, :])
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse_ptr + split_off * stride_ls + tok * stride_lt + head * stride_lh, lse,
                 mask=row_ok)


def _tile_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """(TILE_N, num_warps): keys per step sized so the K/V tiles fit in registers.

    Measured by compiling for sm_90 (ptxas resource usage, no spills): 16-bit D=64 (64, 4) uses
    136 registers, D=128 (64, 8) 172, D=256 (32, 8) 174, D=512 (16, 8) 158; float32 needs half
    the keys per step (D=128 with (32, 4) spilled 3 KB; (16, 8) uses 72 registers).
    """
    budget = 2048 if dtype == torch.float32 else 8192  # elements of one K tile
    tile_n = max(16, min(64, budget // head_dim))
    num_warps = 4 if head_dim <= 64 and dtype != torch.float32 else 8
    return tile_n, num_warps


def _pick_splits(q: torch.Tensor, live_programs: int, max_keys: int, tile_n: int) -> int:
    """Split the KV range only for decode-like batches that leave the GPU under-occupied."""
    if q.device.type != "cuda" or q.shape[0] > 4096:
        return 1
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    want = triton.cdiv(4 * sms, max(live_programs, 1))  # aim for ~4 programs per SM
    # Each split should still stream a few tiles; at most 64 splits.
    return max(1, min(want, triton.cdiv(max_keys, 4 * tile_n), 64))


def paged_attention(
    q: torch.Tensor,  # [T_q, H_q, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, B, H_kv, D], contiguous
    out: torch.Tensor,  # [T_q, H_q, D], written
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1], int32
    seq_lens: torch.Tensor,  # [num_seqs], int32, global lengths incl. the new tokens
    block_table: torch.Tensor,  # [num_seqs, max_blocks], int32
    softmax_scale: float,
    *,
    sliding_window: int | None = None,
    cp: CPLayout = NO_CP,
    return_lse: bool = False,
    num_kv_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor | None:
    """Triton twin of :func:`pagedserve.kernels.reference.paged_attention_ref`."""
    _, bs, h_kv, d, h_q, num_seqs = check_paged_attention(
        q, kv_cache, out, cu_seqlens_q, seq_lens, block_table, softmax_scale, sliding_window,
        cp, TRITON_KV_CACHE_DTYPES)
    check_triton_head_dim(d)
    check_kv_scales(k_scale, v_scale)
    if num_kv_splits is not None and num_kv_splits < 1:
        raise KernelArgumentError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    t_q = q.shape[0]
    lse = torch.full((t_q, h_q), -math.inf, dtype=torch.float32, device=q.device)
    if t_q == 0 or num_seqs == 0:
        return lse if return_lse else None
    group = h_q // h_kv
    group_pad = triton.next_power_of_2(group)
    tile_n, num_warps = _tile_config(d, q.dtype)
    # Rows per program: 16 (the tl.dot minimum) suits decode, where KV traffic dominates; for
    # prefill-heavy batches 64 rows cut KV re-reads 4x (with 8 warps, 16-bit D<=128 fits sm_90's
    # register file). float32 on GPU stays at 16 rows: 64 spills there.
    block_m = 16
    prefill_heavy = t_q >= 4 * num_seqs and d <= 128
    if prefill_heavy and not (q.is_cuda and q.dtype == torch.float32):
        block_m, num_warps = 64, 8
    block_q = max(1, block_m // group_pad)
    q_tiles = t_q // block_q + num_seqs  # upper bound on sum of cdiv(q_len, BLOCK_Q)
    max_keys = block_table.shape[1] * bs
    live = min(q_tiles, t_q) * h_kv  # programs with work, at most one per new token
    splits = num_kv_splits or _pick_splits(q, live, max_keys, tile_n)
    if splits > 1:
        part_out = torch.empty((splits, t_q, h_q, d), dtype=torch.float32, device=q.device)
        # -inf LSE marks padding rows (past cu_seqlens_q[-1]) empty: they merge to 0 / -inf.
        part_lse = torch.full((splits, t_q, h_q), -math.inf, dtype=torch.float32,
                              device=q.device)
        dst_out, dst_lse = part_out, part_lse
    else:
        dst_out, dst_lse = out, lse.unsqueeze(0)
    _paged_attention_kernel[(q_tiles, h_kv, splits)](
        q, kv_cache, dst_out, dst_lse, cu_seqlens_q, seq_lens, block_table,
        num_seqs, float(softmax_scale) * _LOG2E, float(k_scale), float(v_scale),
        int(sliding_window or 0),
        cp.rank, cp.size, cp.interleave,
        q.stride(0), q.stride(1),
        dst_out.stride(0) if splits > 1 else 0, dst_out.stride(-3), dst_out.stride(-2),
        dst_lse.stride(0), dst_lse.stride(1), dst_lse.stride(2),
        block_table.stride(0),
        NUM_KV_HEADS=h_kv, GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=d,
        BLOCK_SIZE=bs, TILE_N=tile_n, NUM_SPLITS=splits, HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        DEQUANT=kv_cache.dtype != q.dtype or (k_scale, v_scale) != (1.0, 1.0),
        num_warps=num_warps,
    )
    if splits > 1:
        merge_into(part_out, part_lse, out, lse)  # writes through out's strides
    return lse if return_lse else None
