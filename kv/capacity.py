"""Capacity under the allocation policy: the tokens a request reserves at admission, the peak
blocks one request can hold, and whether it fits an empty cache. Read-only arithmetic, owned
by ``KVCacheManager`` (which answers these questions through it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from pagedserve.kv.errors import InvalidArgumentError, RequestTooLargeError
from pagedserve.kv.request import KVRequest
from pagedserve.kv.specs import KVCacheSpec, SlidingWindowSpec

__all__ = ["AllocationPolicy", "Capacity"]

AllocationPolicy = Literal["paged", "reserve"]


class Capacity:
    """What one request can ever need, per the manager's policy and KV groups.

    Args:
        policy: ``"paged"`` (blocks on demand) or ``"reserve"`` (a reservation at admission).
        group_specs: one spec per KV group.
        block_size: the manager's (virtual) block size.
        max_model_len: longest request in tokens.
        num_usable_blocks: blocks of the device pool a request may hold (null block excluded).
        reserve_tokens: the ``reserve`` policy's per-request reservation (None: max_model_len).
    """

    def __init__(
        self,
        policy: AllocationPolicy,
        group_specs: Sequence[KVCacheSpec],
        block_size: int,
        max_model_len: int,
        num_usable_blocks: int,
        reserve_tokens: Callable[[KVRequest], int] | None,
    ) -> None:
        if policy not in ("paged", "reserve"):
            raise InvalidArgumentError(f"unknown allocation policy {policy!r}")
        if reserve_tokens is not None and policy != "reserve":
            raise InvalidArgumentError("reserve_tokens needs policy='reserve'")
        self.policy: AllocationPolicy = policy
        self.group_specs = tuple(group_specs)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_usable_blocks = num_usable_blocks
        self._reserve_blocks = -(-max_model_len // block_size)
        self._reserve_tokens = reserve_tokens

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
        never fit, even alone in an empty cache."""
        if num_tokens_total < 0:
            raise InvalidArgumentError(f"negative token count {num_tokens_total}")
        if num_tokens_total > self.max_model_len:
            raise RequestTooLargeError(
                f"{num_tokens_total} tokens exceed max_model_len={self.max_model_len}"
            )
        need = self.blocks_needed(num_tokens_total)
        if need > self.num_usable_blocks:
            raise RequestTooLargeError(
                f"{num_tokens_total} tokens need {need} blocks, the cache holds "
                f"{self.num_usable_blocks}"
            )

    def blocks_needed(self, num_tokens: int) -> int:
        """Peak blocks (all groups) one request of ``num_tokens`` tokens holds."""
        bs = self.block_size
        if self.policy == "reserve":
            return self._reserve_blocks * len(self.group_specs)
        total = 0
        for spec in self.group_specs:
            full = -(-num_tokens // bs)
            if isinstance(spec, SlidingWindowSpec):
                full = min(full, -(-(spec.sliding_window - 1) // bs) + 1)
            total += full
        return total
