"""Controller-side paged KV block management: pure Python + numpy (no torch, no ray).

The scheduler talks to :class:`KVCacheManager`; requests keep their block hashes current with
:class:`BlockHasher`.
"""

from __future__ import annotations

from pagedserve.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock, make_cache_key
from pagedserve.kv.capacity import AllocationPolicy
from pagedserve.kv.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    KVCacheError,
    RequestTooLargeError,
    UnknownRequestError,
)
from pagedserve.kv.group_managers import (
    FullAttentionManager,
    KVCacheBlocks,
    SingleTypeManager,
    SlidingWindowManager,
)
from pagedserve.kv.hashing import ROOT_HASH, BlockHasher, hash_block, hash_block_tokens
from pagedserve.kv.manager import KVCacheManager
from pagedserve.kv.prefix_hits import PrefixCacheStats
from pagedserve.kv.request import KVRequest
from pagedserve.kv.specs import (
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    SlidingWindowSpec,
    group_layer_specs,
    max_concurrency,
    num_blocks_from_bytes,
)

__all__ = [
    "ROOT_HASH",
    "AllocationPolicy",
    "BlockHasher",
    "BlockPool",
    "DoubleFreeError",
    "FreeBlockQueue",
    "FullAttentionManager",
    "FullAttentionSpec",
    "InvalidArgumentError",
    "KVBlock",
    "KVCacheBlocks",
    "KVCacheError",
    "KVCacheGroup",
    "KVCacheManager",
    "KVCacheSpec",
    "KVRequest",
    "PrefixCacheStats",
    "RequestTooLargeError",
    "SingleTypeManager",
    "SlidingWindowManager",
    "SlidingWindowSpec",
    "UnknownRequestError",
    "group_layer_specs",
    "hash_block",
    "hash_block_tokens",
    "make_cache_key",
    "max_concurrency",
    "num_blocks_from_bytes",
]
