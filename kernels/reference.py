"""Pure-torch references for the paged-attention kernels (the engine's CPU path).

Each function has the same signature and semantics as its Triton launcher, and is vectorised:
no Python loop over tokens. Attention groups sequences with similar key counts (decodes batch
together; a long prefill is cut into query chunks to bound the score matrix), gathers each
group's K and V through the block table with one ``index_select`` of D-element rows straight
into ``[S, H_kv, N, D]``, and runs batched matmuls, or the fused
``scaled_dot_product_attention`` when no LSE is needed. Math is float32 (float64 for float64).
The batching, the indices and the masks depend on the step's metadata only: an
``AttentionPlan`` holds them, so the engine builds them once per step, not once per layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedserve.kernels._checks import (
    check_copy_blocks,
    check_kv_scales,
    check_merge,
    check_paged_attention,
    check_reshape_and_cache,
)
from pagedserve.kernels.cp_layout import NO_CP, CPLayout, cp_global_position, cp_local_seq_len
from pagedserve.kernels.errors import KernelArgumentError
from pagedserve.kernels.kv_quant import dequantize_kv, quantize_kv

# Upper bound on elements of one score matrix [S, H_q, Q, N] built by the attention reference.
_SCORE_BUDGET = 1 << 24
# Sequences with at most this many new tokens are padded and batched together.
SMALL_Q = 16


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The references' math dtype: float64 stays float64, everything else runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def reshape_and_cache_ref(
    key: torch.Tensor,  # [T, H_kv, D]
    value: torch.Tensor,  # [T, H_kv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, B, H_kv, D], contiguous
    slot_mapping: torch.Tensor,  # [T], int32/int64; slot = block_id * B + offset; -1 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Writes each token's key and value into its cache slot; slots < 0 are left untouched.

    A cache of another dtype than the keys' (bfloat16, fp8) stores ``key / k_scale`` and
    ``value / v_scale`` rounded to it, fp8 saturated at +-448 (``kv_quant.quantize_kv``)."""
    check_reshape_and_cache(key, value, kv_cache, slot_mapping)
    check_kv_scales(k_scale, v_scale)
    bs = kv_cache.shape[2]
    slots = slot_mapping.long()
    if not bool((slots >= 0).all()):  # under CP; a boolean mask costs a scan, so only then
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    # Token rows of the cache viewed as [num_blocks * 2 * B, H_kv * D]: K of slot (blk, off) is
    # row blk * 2B + off, its V B rows later. index_copy_ beats an advanced-index put here.
    width = kv_cache.shape[3] * kv_cache.shape[4]
    rows = kv_cache.view(kv_cache.shape[0] * 2 * bs, width)
    dst = (slots // bs) * (2 * bs) + slots % bs
    k = quantize_kv(key.reshape(key.shape[0], width), rows.dtype, k_scale)
    v = quantize_kv(value.reshape(value.shape[0], width), rows.dtype, v_scale)
    if rows.element_size() == 1:  # CPU index_copy_ has no fp8 kernel: copy the bytes
        rows, k, v = rows.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    rows.index_copy_(0, dst, k.to(rows.dtype))
    rows.index_copy_(0, dst + bs, v.to(rows.dtype))


def _attend(
    q: torch.Tensor,  # [S, Q, H_q, D], compute dtype
    k: torch.Tensor,  # [S, H_kv, N, D], compute dtype
    v: torch.Tensor,  # [S, H_kv, N, D], compute dtype
    bias: torch.Tensor,  # [S, 1, G*Q, N], compute dtype: 0 where visible, -inf elsewhere
    scale: float,
    need_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masked softmax attention; returns out [S, Q, H_q, D] and natural-log lse [S, Q, H_q]."""
    s, nq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    # GQA without repeating K/V: fold the group's heads into the query rows of one kv head.
    qh = q.reshape(s, nq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(s, hkv, g * nq, d)
    if not need_lse:
        # Every row sees at least its own key here, so the fused kernel never meets an empty row.
        # An additive float mask keeps SDPA on its fused CPU kernel (a bool mask does not).
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=bias, scale=scale)
        lse = None
    else:
        scores = torch.matmul(qh, k.transpose(-1, -2)).mul_(scale).add_(bias)  # [S, H_kv, G*Q, N]
        lse = torch.logsumexp(scores, dim=-1)  # [S, H_kv, G*Q]; -inf where nothing is visible
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        probs = torch.exp_(scores.sub_(safe.unsqueeze(-1)))
        o = torch.matmul(probs, v)  # [S, H_kv, G*Q, D]
        lse = lse.reshape(s, hkv, g, nq).permute(0, 3, 1, 2).reshape(s, nq, hq)
    o = o.reshape(s, hkv, g, nq, d).permute(0, 3, 1, 2, 4).reshape(s, nq, hq, d)
    return o, lse


@dataclass(frozen=True, slots=True)
class _Launch:
    """One batched attention call over S items, padded to Q queries and N keys each."""

    rows: torch.Tensor  # [S * Q] int64 token row of each query; padding repeats a real row
    ok_flat: torch.Tensor | None  # [R] int64 real queries among the S * Q; None: all are
    out_rows: torch.Tensor  # [R] int64 their token rows
    k_rows: torch.Tensor  # [S * H_kv * N] int64 rows of kv_cache.view(-1, D) holding the keys
    bias: torch.Tensor  # [S, 1, G * Q, N] additive mask in the compute dtype
    # Gather destinations by cache dtype, [2, S * H_kv * N, D], reused by every layer: a fresh
    # tensor of that size per layer is page-faulted in anew each time (glibc maps and unmaps
    # large blocks), which cost more than the gather itself.
    scratch: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """What ``paged_attention_ref`` derives from the step's metadata alone: the batching of the
    sequences, the K/V row indices through the block table and the causal/window masks.

    Built once per step and KV-cache group and shared by every layer of the group, whose calls
    differ only in ``q``, ``out`` and the layer's ``kv_cache`` (same shape)."""

    num_tokens: int
    block_size: int
    num_kv_heads: int
    num_q_heads: int
    sliding_window: int | None
    cp: CPLayout
    dtype: torch.dtype
    launches: tuple[_Launch, ...]


def _plan_launch(
    items: list[tuple[int, int, int]],  # (seq, first new-token index, count)
    cu: list[int],
    lens: list[int],
    block_table: torch.Tensor,
    bs: int,
    hkv: int,
    group: int,
    window: int | None,
    cp: CPLayout,
    cdtype: torch.dtype,
) -> _Launch:
    rank, size, inter = cp.rank, cp.size, cp.interleave
    dev = block_table.device
    max_blocks = block_table.shape[1]
    seq_idx = torch.tensor([it[0] for it in items], device=dev)
    q_first = torch.tensor([it[1] for it in items], device=dev)  # [S]
    q_cnt = torch.tensor([it[2] for it in items], device=dev)  # [S]
    seq_len = torch.tensor([lens[it[0]] for it in items], device=dev)  # [S]
    q_len = torch.tensor([cu[it[0] + 1] - cu[it[0]] for it in items], device=dev)  # [S]
    tok0 = torch.tensor([cu[it[0]] for it in items], device=dev)  # [S]
    nq = max(it[2] for it in items)
    ns = len(items)
    ctx = seq_len - q_len  # global position of new token 0
    # Keys needed by the items: local indices [j_lo, j_hi) (the local packing is monotone).
    last_pos = ctx + q_first + q_cnt - 1  # [S]
    j_hi = cp_local_seq_len(last_pos + 1, rank, size, inter)
    if window is not None:
        j_lo = cp_local_seq_len((ctx + q_first - window + 1).clamp(min=0), rank, size, inter)
    else:
        j_lo = torch.zeros_like(j_hi)
    # The blocks covering [j_lo, j_hi), read as D-element rows straight into [S, H_kv, N, D]
    # (N = nb * B) by one index_select per tensor: no separate layout copy.
    b_lo = j_lo // bs
    b_hi = (j_hi + bs - 1) // bs
    nb = max(int((b_hi - b_lo).max()), 1)
    col = b_lo.unsqueeze(1) + torch.arange(nb, device=dev)  # [S, nb]
    col_ok = col < b_hi.unsqueeze(1)
    ids = block_table[seq_idx.unsqueeze(1), col.clamp(max=max_blocks - 1)].long()
    ids = torch.where(col_ok, ids, torch.zeros_like(ids))  # unused table entries may be garbage
    heads = torch.arange(hkv, device=dev).view(1, hkv, 1, 1)
    offs = torch.arange(bs, device=dev).view(1, 1, 1, bs)
    k_rows = ((ids.view(ns, 1, nb, 1) * 2 * bs + offs) * hkv + heads).reshape(-1)  # K at index 0
    j = (b_lo * bs).unsqueeze(1) + torch.arange(nb * bs, device=dev)  # [S, N] local indices
    key_ok = (j >= j_lo.unsqueeze(1)) & (j < j_hi.unsqueeze(1))
    key_pos = cp_global_position(j, rank, bs, size, inter)  # [S, N]
    i = torch.arange(nq, device=dev)
    q_ok = i.unsqueeze(0) < q_cnt.unsqueeze(1)  # [S, Q]
    q_pos = (ctx + q_first).unsqueeze(1) + i  # [S, Q] global positions
    rows = tok0.unsqueeze(1) + q_first.unsqueeze(1) + torch.where(q_ok, i, torch.zeros_like(i))
    visible = key_ok.unsqueeze(1) & (key_pos.unsqueeze(1) <= q_pos.unsqueeze(2))  # [S, Q, N]
    if window is not None:
        visible &= key_pos.unsqueeze(1) > (q_pos - window).unsqueeze(2)
    # Padding query rows get one visible key so the fused path never sees an empty row.
    visible[:, :, 0] |= ~q_ok
    mask = visible.unsqueeze(1).expand(ns, group, nq, -1).reshape(ns, 1, group * nq, -1)
    bias = torch.zeros(mask.shape, dtype=cdtype, device=dev).masked_fill_(~mask, -math.inf)
    flat_ok = q_ok.reshape(-1)
    ok_flat = None if bool(flat_ok.all()) else flat_ok.nonzero().squeeze(1)
    return _Launch(rows.reshape(-1), ok_flat, rows[q_ok], k_rows, bias)


def plan_paged_attention(
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1], int32
    seq_lens: torch.Tensor,  # [num_seqs], int32
    block_table: torch.Tensor,  # [num_seqs, max_blocks], int32
    *,
    block_size: int,
    num_kv_heads: int,
    num_q_heads: int,
    head_dim: int,
    sliding_window: int | None = None,
    cp: CPLayout = NO_CP,
    dtype: torch.dtype = torch.float32,
) -> AttentionPlan:
    """The plan ``paged_attention_ref`` follows for this metadata (``dtype`` is the compute dtype:
    float64 for float64 inputs, float32 otherwise)."""
    cu = [int(x) for x in cu_seqlens_q.tolist()]
    lens = [int(x) for x in seq_lens.tolist()]
    for s in range(len(lens)):
        if cu[s + 1] - cu[s] > lens[s]:
            raise KernelArgumentError(
                f"sequence {s} has {cu[s + 1] - cu[s]} new tokens but length {lens[s]}"
            )
    hq, hkv = num_q_heads, num_kv_heads
    batches: list[list[tuple[int, int, int]]] = []
    # Decodes (and other short query runs) are padded into batches of similar key counts (the
    # padding costs gathers and FLOPs); longer query runs are cut into chunks.
    small: list[tuple[int, int]] = []  # (keys to read, seq)
    for s, length in enumerate(lens):
        q_len = cu[s + 1] - cu[s]
        if q_len == 0:
            continue
        if q_len <= SMALL_Q:
            small.append((min(length, (sliding_window or length) + q_len) // cp.size + 1, s))
            continue
        chunk = max(1, _SCORE_BUDGET // max(1, hq * (length // cp.size + 1)))
        batches.extend([(s, first, min(chunk, q_len - first))] for first in range(0, q_len, chunk))
    small.sort(reverse=True)
    group: list[tuple[int, int, int]] = []
    group_keys, group_q = 0, 0
    for keys, s in small:
        q_len = cu[s + 1] - cu[s]
        width = max(hq * max(group_q, q_len), 2 * hkv * head_dim)  # per-key cost
        if group and ((len(group) + 1) * group_keys * width > _SCORE_BUDGET
                      or 2 * keys < group_keys):
            batches.append(group)
            group, group_keys, group_q = [], 0, 0
        group.append((s, 0, q_len))
        group_keys, group_q = max(group_keys, keys), max(group_q, q_len)
    if group:
        batches.append(group)
    launches = tuple(
        _plan_launch(items, cu, lens, block_table, block_size, hkv, hq // hkv, sliding_window,
                     cp, dtype)
        for items in batches
    )
    return AttentionPlan(cu[-1] if cu else 0, block_size, hkv, hq, sliding_window, cp, dtype,
                         launches)


def paged_attention_ref(
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
    plan: AttentionPlan | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor | None:
    """Causal varlen attention of new tokens over their sequences' paged KV.

    A cache of another dtype than ``q``'s is read as ``stored * k_scale`` (``v_scale``) in the
    compute dtype (the inverse of :func:`reshape_and_cache_ref`'s write).

    Query ``i`` of a sequence with ``L`` tokens, ``q_len`` of them new, sits at global position
    ``L - q_len + i`` and sees keys at positions ``p <= pos`` (and ``p > pos - sliding_window``).
    With ``cp.size > 1`` only this rank's interleaved shard of the keys is attended (see
    ``cp_layout``). Rows of ``out`` past ``cu_seqlens_q[-1]`` (padding) are left unspecified,
    their LSE is -inf. ``num_kv_splits`` is a tuning hint for the Triton path (``None`` lets it
    choose; the split-KV path merges partial results with the LSE rule) and is ignored here.
    ``plan`` is :func:`plan_paged_attention` of the same metadata, built once and reused by
    every layer; without it the call builds its own.

    Returns:
        The natural-log LSE ``[T_q, H_q]`` float32 if ``return_lse`` (``-inf`` where a query sees
        no key; its output row is 0), else None.
    """
    del num_kv_splits
    _, bs, hkv, d, hq, _ = check_paged_attention(
        q, kv_cache, out, cu_seqlens_q, seq_lens, block_table, softmax_scale, sliding_window, cp)
    check_kv_scales(k_scale, v_scale)
    cdtype = compute_dtype(q.dtype)
    if plan is None:
        plan = plan_paged_attention(cu_seqlens_q, seq_lens, block_table, block_size=bs,
                                    num_kv_heads=hkv, num_q_heads=hq, head_dim=d,
                                    sliding_window=sliding_window, cp=cp, dtype=cdtype)
    elif plan.num_tokens > q.shape[0] or (
        plan.block_size, plan.num_kv_heads, plan.num_q_heads, plan.sliding_window, plan.cp,
        plan.dtype) != (bs, hkv, hq, sliding_window, cp, cdtype):
        raise KernelArgumentError("the attention plan was built for other shapes or settings")
    lse_out = torch.full((q.shape[0], hq), -math.inf, dtype=torch.float32, device=q.device)
    # Without CP every query sees its own key, so the fused SDPA path is safe when no LSE is
    # asked for; with CP a rank may hold no visible key for a query (empty row).
    need_lse = return_lse or cp.size > 1
    rows_of = kv_cache.view(-1, d)  # [num_blocks * 2 * B * H_kv, D]
    for la in plan.launches:
        ns, n = la.bias.shape[0], la.bias.shape[-1]
        buf = la.scratch.get(kv_cache.dtype)
        if buf is None or buf.device != kv_cache.device:
            buf = torch.empty((2, la.k_rows.shape[0], d), dtype=kv_cache.dtype,
                              device=kv_cache.device)
            la.scratch[kv_cache.dtype] = buf
        torch.index_select(rows_of, 0, la.k_rows, out=buf[0])
        torch.index_select(rows_of, 0, la.k_rows + bs * hkv, out=buf[1])
        k = dequantize_kv(buf[0].view(ns, hkv, n, d), cdtype, k_scale)
        v = dequantize_kv(buf[1].view(ns, hkv, n, d), cdtype, v_scale)
        nq = la.rows.shape[0] // ns
        qs = q.index_select(0, la.rows).view(ns, nq, hq, d).to(cdtype)
        o, lse = _attend(qs, k, v, la.bias, float(softmax_scale), need_lse)
        o = o.reshape(ns * nq, hq, d)
        if la.ok_flat is not None:
            o = o.index_select(0, la.ok_flat)
        out.index_copy_(0, la.out_rows, o.to(out.dtype))
        if need_lse and lse is not None:
            lse = lse.reshape(ns * nq, hq)
            if la.ok_flat is not None:
                lse = lse.index_select(0, la.ok_flat)
            lse_out.index_copy_(0, la.out_rows, lse.float())
    return lse_out if return_lse else None


def merge_attn_states_ref(
    outputs: torch.Tensor,  # [N, T, H, D], each shard's normalised output
    lses: torch.Tensor,  # [N, T, H], float32, natural-log LSE of each shard
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges N partial attention results by their LSEs.

    ``lse = log sum_r exp(lse_r)``, ``out = sum_r exp(lse_r - lse) * out_r``. A shard whose LSE is
    -inf, +inf or NaN is empty and contributes nothing (its output may hold garbage). Where every
    shard is empty the output is 0 and the LSE -inf.

    Returns:
        (out ``[T, H, D]`` in ``outputs.dtype``, lse ``[T, H]`` float32).
    """
    check_merge(outputs, lses)
    cdtype = compute_dtype(outputs.dtype)
    lse = lses.to(cdtype)
    lse = torch.where(torch.isnan(lse) | (lse == math.inf), torch.full_like(lse, -math.inf), lse)
    m = lse.max(dim=0).values  # [T, H]
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe)  # [N, T, H]; 0 for empty shards
    total = w.sum(dim=0)  # [T, H]
    merged_lse = torch.where(total > 0, m_safe + torch.log(total), torch.full_like(m, -math.inf))
    frac = w / torch.where(total > 0, total, torch.ones_like(total))
    contrib = torch.where((frac > 0).unsqueeze(-1), frac.unsqueeze(-1) * outputs.to(cdtype), 0.0)
    return contrib.sum(dim=0).to(outputs.dtype), merged_lse.to(torch.float32)


def copy_blocks_ref(
    kv_caches: Sequence[torch.Tensor],  # per layer [num_blocks, ...], contiguous
    src_to_dst: torch.Tensor | Sequence[Sequence[int]],  # [n, 2] int64 (src, dst) block ids
) -> None:
    """Copies whole blocks ``src -> dst`` in every layer (copy-on-write).

    Destinations must be distinct and must not also be sources in the same call.
    """
    pairs = check_copy_blocks(kv_caches, src_to_dst)
    if pairs.numel() == 0:
        return
    src, dst = pairs[:, 0], pairs[:, 1]
    for cache in kv_caches:
        cache[dst] = cache[src]
