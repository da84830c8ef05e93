"""The forward context: the per-step attention metadata, set once with a ``with`` block.

It is the only module-level state the workers keep. Attention layers read it; nothing else
should. The block refuses to nest so a stale context can never leak into the next step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from pagedserve.kernels import NO_CP, AttentionPlan, CPLayout

if TYPE_CHECKING:
    from pagedserve.workers.block_table import BlockTable


@dataclass(slots=True)
class AttentionMetadata:
    """Metadata of one KV-cache group for one step (all tensors on the model's device)."""

    slot_mapping: torch.Tensor  # [T] int64, -1 = token not stored on this rank
    block_table: torch.Tensor  # [R, max_blocks] int32, kernel block ids
    seq_lens: torch.Tensor  # [R] int32, tokens incl. this step's
    cu_seqlens_q: torch.Tensor  # [R + 1] int32, query offsets into the T tokens
    plans: dict[tuple, AttentionPlan] = field(default_factory=dict)
    """The CPU attention path's plans for this step, built by the group's first layer."""


@dataclass(slots=True)
class ForwardContext:
    groups: list[AttentionMetadata]
    """One entry per KV-cache group; a layer reads ``groups[layer.kv_group]``."""
    cp: CPLayout = NO_CP


_CONTEXT: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _CONTEXT
    if _CONTEXT is not None:
        raise RuntimeError("forward_context does not nest")
    _CONTEXT = ctx
    try:
        yield ctx
    finally:
        _CONTEXT = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context: run the model inside `with forward_context(...)`")
    return _CONTEXT


def forward_rows(
    model: nn.Module,
    tables: Sequence[BlockTable],
    block_tables: Sequence[torch.Tensor],
    req_idx: np.ndarray,
    positions: np.ndarray,
    ids: np.ndarray | torch.Tensor,
    seq_lens: np.ndarray,
    counts: np.ndarray,
    sel: np.ndarray | None = None,
    cp: CPLayout = NO_CP,
) -> torch.Tensor:
    """One forward pass over some rows' tokens after a step's main pass: tokens ``ids`` of
    batch rows ``req_idx`` at ``positions`` ([T] each), ``counts`` tokens per row and
    ``seq_lens`` ([N]); ``sel`` picks the rows of the step's device ``block_tables`` (one per
    group, [R, width]; None: all R). Returns hidden states [T, hidden]."""
    dev = block_tables[0].device
    cu = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=cu[1:])
    cu_dev, seq_dev = to_device(cu, dev, torch.int32), to_device(seq_lens, dev, torch.int32)
    pick = None if sel is None else to_device(sel, dev)
    groups = [
        AttentionMetadata(
            slot_mapping=to_device(table.slot_mapping(req_idx, positions), dev),
            block_table=full if pick is None else full.index_select(0, pick),
            seq_lens=seq_dev,
            cu_seqlens_q=cu_dev,
        )
        for table, full in zip(tables, block_tables, strict=True)
    ]
    ids_dev = ids if isinstance(ids, torch.Tensor) else to_device(ids, dev)
    with forward_context(ForwardContext(groups, cp)):
        return model(ids_dev, to_device(positions, dev))  # type: ignore[no-any-return]


def to_device(a: np.ndarray, device: torch.device,
              dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host array on ``device`` as ``dtype`` (a non-blocking copy)."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(device, dtype, non_blocking=True)
