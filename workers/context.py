"""The forward context: the per-step attention metadata, set once with a ``with`` block.

It is the only module-level state the workers keep. Attention layers read it; nothing else
should. The block refuses to nest so a stale context can never leak into the next step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from pagedserve.kernels import NO_CP, AttentionPlan, CPLayout


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
