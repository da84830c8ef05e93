"""Collectives over a ``ParallelState``; every one is a no-op (returns its input) at size 1."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pagedserve.parallel.state import ParallelState


def all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum ``x`` over the group, in place."""
    if state.size == 1:
        return x
    dist.all_reduce(x, group=state.group)
    return x


def all_gather(x: torch.Tensor, state: ParallelState, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    if state.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(state.size)]
    dist.all_gather(parts, x.contiguous(), group=state.group)
    return torch.cat(parts, dim=dim)


def reduce_scatter(x: torch.Tensor, state: ParallelState, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's slice of ``dim``."""
    if state.size == 1:
        return x
    if dist.get_backend(state.group) == "gloo":
        # gloo has no reduce_scatter: reduce everything, keep this rank's slice.
        x = x.contiguous()
        dist.all_reduce(x, group=state.group)
        return x.chunk(state.size, dim=dim)[state.rank].contiguous()
    chunks = [c.contiguous() for c in x.chunk(state.size, dim=dim)]
    out = torch.empty_like(chunks[state.rank])
    dist.reduce_scatter(out, chunks, group=state.group)
    return out


def broadcast(x: torch.Tensor, state: ParallelState, src: int = 0) -> torch.Tensor:
    if state.size == 1:
        return x
    dist.broadcast(x, src=src, group=state.group)
    return x
