"""Capacity questions of the KV manager: what one request can ever need, and whether it fits
an empty cache. A mixin of ``KVCacheManager``, read-only."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedserve.kv.base import KVRequest
from pagedserve.kv.block_pool import BlockPool
from pagedserve.kv.errors import InvalidArgumentError, RequestTooLargeError
from pagedserve.kv.specs import KVCacheSpec, SlidingWindowSpec

__all__ = ["CapacityMixin"]


class CapacityMixin:
    block_size: int
    max_model_len: int
    policy: str
    group_specs: tuple[KVCacheSpec, ...]
    pool: BlockPool
    managers: Sequence[object]
    _reserve_blocks: int
    _reserve_tokens: Callable[[KVRequest], int] | None

    def reservation_tokens(self, request: KVRequest) -> int:
        """Tokens the ``reserve`` policy holds for ``request`` (0 under ``paged``)."""
        if self.policy != "reserve":
            return 0
        if self._reserve_tokens is None:
            return self.max_model_len
        want = self._reserve_tokens(request)
        if isinstance(want, bool) or not isinstance(want, int) or want < 0:
            raise InvalidArgumentError(f"reserve_tokens returned {want!r}, not a count >= 0")
        return min(want, self.max_model_len)

    def check_admissible(self, num_tokens_total: int) -> None:
        """Raise RequestTooLargeError if a request of this many tokens (prompt + max output) can
        never fit, even alone in an empty cache; the scheduler calls this at admission instead
        of letting the request wait forever."""
        if num_tokens_total < 0:
            raise InvalidArgumentError(f"negative token count {num_tokens_total}")
        if num_tokens_total > self.max_model_len:
            raise RequestTooLargeError(
                f"{num_tokens_total} tokens exceed max_model_len={self.max_model_len}"
            )
        need = self.blocks_needed(num_tokens_total)
        if need > self.pool.num_usable_blocks:
            raise RequestTooLargeError(
                f"{num_tokens_total} tokens need {need} blocks, the cache holds "
                f"{self.pool.num_usable_blocks}"
            )

    def blocks_needed(self, num_tokens: int) -> int:
        """Peak blocks (all groups) one request of ``num_tokens`` tokens holds."""
        bs = self.block_size
        if self.policy == "reserve":
            return self._reserve_blocks * len(self.managers)
        total = 0
        for spec in self.group_specs:
            full = -(-num_tokens // bs)
            if isinstance(spec, SlidingWindowSpec):
                full = min(full, -(-(spec.sliding_window - 1) // bs) + 1)
            total += full
        return total
