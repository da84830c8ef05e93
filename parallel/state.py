"""Tensor-parallel state: which rank this process is, of how many, and over which group.

The state is passed into every parallel layer explicitly (never looked up from a global), so a
layer built with ``ParallelState(0, 1)`` works without any process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class ParallelState:
    """One rank of a tensor-parallel group. ``group`` is None for a single rank."""

    rank: int = 0
    size: int = 1
    group: Any = None
    """A ``torch.distributed`` process group (None: the default group when ``size > 1``)."""

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid parallel state: rank {self.rank} of size {self.size}")

    @property
    def is_single(self) -> bool:
        return self.size == 1


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division; raises when a dimension cannot be split evenly."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def open_store(world_size: int, host: str = "0.0.0.0", timeout_s: float = 300.0) -> Any:
    """Rank 0's rendezvous store on a free port (read ``store.port``); others join with
    :func:`join_process_group` given that port."""
    return dist.TCPStore(
        host,
        0,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def join_process_group(
    rank: int,
    world_size: int,
    backend: str,
    *,
    init_method: str | None = None,
    store: Any = None,
    master: tuple[str, int] | None = None,
    timeout_s: float = 300.0,
) -> ParallelState:
    """Join the default process group and return this rank's state (size 1: no group at all).

    Rendezvous by one of: ``init_method`` (``tcp://host:port``, rank 0 hosts it), ``store``
    (rank 0's store from :func:`open_store`) or ``master`` (``(host, port)`` of that store,
    for the other ranks). Blocks until every rank has joined or ``timeout_s`` passes.
    """
    if world_size == 1:
        return ParallelState(0, 1)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if store is None and master is not None:
            store = dist.TCPStore(
                master[0], master[1], world_size, is_master=False, timeout=timeout
            )
        if store is None and init_method is None:
            raise ValueError("world_size > 1 needs an init_method, a store or a master address")
        dist.init_process_group(
            backend=backend,
            init_method=None if store is not None else init_method,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    return ParallelState(rank, world_size, None)


def init_dcp_state(tp: ParallelState, dcp_size: int) -> ParallelState:
    """The decode-context-parallel group of this TP rank: ``dcp_size`` consecutive TP ranks.

    Consecutive ranks are the ones that hold the same (replicated) KV heads. Every TP rank must
    call this (``new_group`` is collective), with the same ``dcp_size``.
    """
    divide(tp.size, dcp_size)
    if dcp_size == 1:
        return ParallelState(0, 1)
    if dcp_size == tp.size:
        return ParallelState(tp.rank, dcp_size, tp.group)
    groups = [
        dist.new_group(list(range(g * dcp_size, (g + 1) * dcp_size)))
        for g in range(tp.size // dcp_size)
    ]
    return ParallelState(tp.rank % dcp_size, dcp_size, groups[tp.rank // dcp_size])


def destroy_parallel_state(state: ParallelState) -> None:
    if state.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
