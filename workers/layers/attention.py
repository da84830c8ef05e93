"""Paged attention layer: writes this step's K/V into the paged cache, then attends over it.

The layer owns no KV memory: ``kv_pool`` binds ``kv_cache`` (a view of one pooled tensor) once
the controller has decided the layout. Metadata comes from the forward context.

Decode context parallelism (``dcp.size = W > 1``): the W ranks of a DCP group hold the same
replicated KV heads but each stores only its interleaved share of every sequence's tokens
(the slot mapping gives -1 elsewhere). Each rank all-gathers the group's query heads, attends
them over its local shard (returning the LSE), and the partial results are combined exactly:
every rank rescales its output by ``exp(lse_rank - lse_global)`` and a reduce-scatter over
heads sums the shares and hands each rank back its own heads.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels import paged_attention, reshape_and_cache, scale_from_amax
from pagedserve.parallel import comm
from pagedserve.parallel.state import ParallelState
from pagedserve.workers.context import get_forward_context


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        layer_index: int,
        sliding_window: int | None = None,
        dcp: ParallelState | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_index = layer_index
        self.sliding_window = sliding_window
        self.dcp = dcp or ParallelState()
        self.kv_group = 0
        self.kv_cache: torch.Tensor | None = None  # [NB, 2, B, Hkv, D], bound by kv_pool
        self.k_scale = 1.0  # the cache holds K / k_scale (fp8 caches; set by kv_pool)
        self.v_scale = 1.0
        self.calibrate_kv_scales = False  # take the scales from the next tokens written

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D], contiguous; k, v: [T, Hkv, D], may be views -> out [T, Hq, D]
        if self.kv_cache is None:
            raise RuntimeError(f"layer {self.layer_index} has no KV cache bound")
        ctx = get_forward_context()
        md = ctx.groups[self.kv_group]
        if self.calibrate_kv_scales:
            self._calibrate(k, v, md.slot_mapping)
        reshape_and_cache(k, v, self.kv_cache, md.slot_mapping, self.k_scale, self.v_scale)
        w = self.dcp.size
        if w > 1:
            q = comm.all_gather(q, self.dcp, dim=1)  # [T, W * Hq, D]
        out = torch.empty_like(q)
        lse = paged_attention(
            q,
            self.kv_cache,
            out,
            md.cu_seqlens_q,
            md.seq_lens,
            md.block_table,
            self.scale,
            sliding_window=self.sliding_window,
            cp=ctx.cp,
            return_lse=w > 1,
            plans=md.plans,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        if w == 1:
            return out
        assert lse is not None  # [T, W * Hq] float32, -inf where this shard saw no key
        lses = comm.all_gather(lse.unsqueeze(0), self.dcp, dim=0)  # [W, T, W * Hq]
        total = torch.logsumexp(lses, dim=0)  # [T, W * Hq]; every query sees >= 1 key somewhere
        share = torch.exp(lse - total).nan_to_num(0.0)  # [T, W * Hq]
        mine = comm.reduce_scatter(out.float() * share.unsqueeze(-1), self.dcp, dim=1)
        return mine.to(out.dtype)  # [T, Hq, D]

    def _calibrate(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scales from the amax of the tokens written now (slot >= 0: padding rows excluded),
        once; a step that writes nothing leaves the calibration armed. Syncs once per layer."""
        keep = slot_mapping >= 0  # [T]
        if not bool(keep.any()):
            return
        self.k_scale = scale_from_amax(float(k[keep].abs().max()))
        self.v_scale = scale_from_amax(float(v[keep].abs().max()))
        self.calibrate_kv_scales = False
