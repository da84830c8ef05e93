"""Contiguous reservations: the Orca-style baselines' address-space constraint.

A system without paging stores each request's KV cache in one contiguous buffer, so a
reservation needs a free *run* of memory, not just enough free memory. The KV manager's
``reserve`` policy takes its blocks from the free queue wherever they are; this module adds the
contiguity constraint on top for the benchmark: every reservation is also placed first-fit in a
model address space of the pool's blocks, admission fails when no run is long enough, and the
free runs that are too short for the next waiting request are the external fragmentation.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from pagedserve.kv import KVCacheBlocks, KVCacheManager, KVRequest

__all__ = ["ContiguousReserveManager", "ExtentAllocator"]


class ExtentAllocator:
    """First-fit allocation of runs in ``[0, size)`` with coalescing frees."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = [0] if size > 0 else []
        self._lengths: list[int] = [size] if size > 0 else []

    @property
    def free_total(self) -> int:
        return sum(self._lengths)

    def runs(self) -> list[int]:
        """Lengths of the free runs, in address order."""
        return list(self._lengths)

    def largest(self) -> int:
        return max(self._lengths, default=0)

    def allocate(self, n: int) -> int | None:
        """Start of a run of ``n`` units, or None if no free run is that long."""
        if n <= 0:
            raise ValueError("allocate at least one unit")
        for i, length in enumerate(self._lengths):
            if length >= n:
                start = self._starts[i]
                if length == n:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += n
                    self._lengths[i] -= n
                return start
        return None

    def release(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        if (i < len(self._starts) and self._starts[i] < start + n) or (
            i > 0 and self._starts[i - 1] + self._lengths[i - 1] > start
        ):
            raise ValueError(f"run [{start}, {start + n}) is not allocated")
        self._starts.insert(i, start)
        self._lengths.insert(i, n)
        if i + 1 < len(self._starts) and start + n == self._starts[i + 1]:
            self._lengths[i] += self._lengths.pop(i + 1)
            del self._starts[i + 1]
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:
            self._lengths[i - 1] += self._lengths.pop(i)
            del self._starts[i]


class ContiguousReserveManager(KVCacheManager):
    """``KVCacheManager(policy="reserve")`` whose reservations must also fit a contiguous run.

    Only admission is gated (a reservation never grows when it covers the whole request, as
    in every baseline here); the block accounting is the real manager's.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        reserve_tokens: Callable[[KVRequest], int] | None = None,
    ) -> None:
        super().__init__(
            None,
            num_blocks,
            block_size,
            max_model_len,
            enable_caching=False,
            policy="reserve",
            reserve_tokens=reserve_tokens,
        )
        self.extents = ExtentAllocator(self.pool.num_usable_blocks)
        self._runs: dict[str, tuple[int, int]] = {}

    def reservation_blocks(self, request: KVRequest) -> int:
        return max(1, -(-self.reservation_tokens(request) // self.block_size))

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        rid = request.request_id
        args = (request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                num_lookahead_tokens)
        if self.has_request(rid):
            return super().allocate_slots(*args)
        n = self.reservation_blocks(request)
        start = self.extents.allocate(n)
        if start is None:
            return None
        out = super().allocate_slots(*args)
        if out is None:
            self.extents.release(start, n)
            return None
        self._runs[rid] = (start, n)
        return out

    def free(self, request: KVRequest | str) -> None:
        super().free(request)
        rid = request if isinstance(request, str) else request.request_id
        run = self._runs.pop(rid, None)
        if run is not None:
            self.extents.release(*run)

    def external_fragmentation_blocks(self, need: int) -> int:
        """Free blocks in runs shorter than ``need``: unusable for a reservation that long."""
        return sum(length for length in self.extents.runs() if length < need)
