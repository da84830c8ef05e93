"""Per-layer KV cache specs, grouping into KV groups, and capacity arithmetic.

A *group* is a set of layers that share one block table: the same block ids index each of its
layers' KV tensors. All groups draw ids from one pool, and tensor ``i`` is shared by layer ``i``
of every group, so every group must have the same page size (bytes per block per layer) and the
pool size is ``kv_bytes // page_bytes // layers_per_group``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagedserve.kv.errors import InvalidArgumentError

__all__ = [
    "FullAttentionSpec",
    "KVCacheGroup",
    "KVCacheSpec",
    "SlidingWindowSpec",
    "group_layer_specs",
    "max_concurrency",
    "num_blocks_from_bytes",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_positive(spec: object, *names: str) -> None:
    for name in names:
        if getattr(spec, name) <= 0:
            raise InvalidArgumentError(f"{name} must be positive")


def _page_size_bytes(spec: KVCacheSpec) -> int:
    """Bytes of one block in one layer: K and V, hence the 2."""
    return 2 * spec.block_size * spec.num_kv_heads * spec.head_size * spec.dtype_bytes


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Every token's K and V are kept for the request's whole life."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        _check_positive(self, "block_size", "num_kv_heads", "head_size", "dtype_bytes")

    @property
    def page_size_bytes(self) -> int:
        return _page_size_bytes(self)

    def max_blocks_per_request(self, max_model_len: int) -> int:
        return _cdiv(max_model_len, self.block_size)

    def max_memory_usage_bytes(self, max_model_len: int) -> int:
        """Worst-case bytes one request of ``max_model_len`` tokens needs per layer."""
        return self.max_blocks_per_request(max_model_len) * self.page_size_bytes


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """Only the last ``sliding_window`` tokens are attended to; older blocks are released."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int
    sliding_window: int

    def __post_init__(self) -> None:
        _check_positive(
            self, "block_size", "num_kv_heads", "head_size", "dtype_bytes", "sliding_window"
        )

    @property
    def page_size_bytes(self) -> int:
        return _page_size_bytes(self)

    def max_blocks_per_request(self, max_model_len: int) -> int:
        # W-1 past tokens plus the current one; the +1 block is because the window need not
        # start on a block boundary.
        window_blocks = _cdiv(self.sliding_window - 1, self.block_size) + 1
        return min(_cdiv(max_model_len, self.block_size), window_blocks)

    def max_memory_usage_bytes(self, max_model_len: int) -> int:
        return self.max_blocks_per_request(max_model_len) * self.page_size_bytes


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers sharing one block table (and one per-group manager)."""

    layer_names: tuple[str, ...]
    spec: KVCacheSpec


def group_layer_specs(layer_specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroup]:
    """Group per-layer specs (in model order) into KV groups of equal size.

    * all specs equal -> one group of every layer;
    * otherwise the page sizes must match (a true hybrid). Layers are bucketed by spec, the
      group size is the smallest bucket (real models are n:1, e.g. 5 sliding : 1 full), and
      each bucket is split into ``ceil(len / size)`` groups. Splits are strided
      (``layers[i::n]``), not contiguous, so pipeline stages get balanced groups. An uneven
      split leaves groups one layer short; they are padded by sizing on the largest group.

    Full-attention buckets come first so group 0 is full attention when there is one.
    Example: 10 full + 20 sliding layers -> 3 groups of 10 (one full, two sliding).
    """
    if not layer_specs:
        return []
    specs = list(layer_specs.values())
    if all(s == specs[0] for s in specs):
        return [KVCacheGroup(tuple(layer_specs), specs[0])]
    pages = {s.page_size_bytes for s in specs}
    if len(pages) != 1:
        raise InvalidArgumentError(
            f"hybrid KV groups need one page size per block, got {sorted(pages)} bytes"
        )
    buckets: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        buckets.setdefault(spec, []).append(name)
    ordered = sorted(buckets.items(), key=lambda kv: not isinstance(kv[0], FullAttentionSpec))
    group_size = min(len(names) for names in buckets.values())
    groups: list[KVCacheGroup] = []
    for spec, names in ordered:
        n = _cdiv(len(names), group_size)
        groups.extend(KVCacheGroup(tuple(names[i::n]), spec) for i in range(n))
    return groups


def num_blocks_from_bytes(kv_bytes: int, groups: Sequence[KVCacheGroup]) -> int:
    """Blocks that fit in ``kv_bytes``: one tensor per layer slot, shared across groups."""
    if not groups:
        return 1  # attention-free model: the pool still needs its null block
    page = groups[0].spec.page_size_bytes
    layers_per_group = max(len(g.layer_names) for g in groups)
    return kv_bytes // page // layers_per_group


def max_concurrency(
    num_blocks: int, groups: Sequence[KVCacheGroup] | Sequence[KVCacheSpec], max_model_len: int
) -> float:
    """How many ``max_model_len`` requests fit at once: usable blocks (null block excluded)
    divided by the blocks one such request needs summed over groups."""
    specs = [g.spec if isinstance(g, KVCacheGroup) else g for g in groups]
    per_request = sum(s.max_blocks_per_request(max_model_len) for s in specs)
    if per_request == 0:
        return math.inf
    return (num_blocks - 1) / per_request
