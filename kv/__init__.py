"""Controller-side paged KV block management: pure Python + numpy (no torch, no ray).

The scheduler talks to :class:`KVCacheManager`; requests keep their block hashes current with
:class:`BlockHasher`.
"""

from __future__ import annotations

from pagedserve.kv.base import KVRequest
from pagedserve.kv.block import FreeBlockQueue, KVBlock
from pagedserve.kv.block_pool import BlockPool, make_cache_key
from pagedserve.kv.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    KVCacheError,
    RequestTooLargeError,
    UnknownRequestError,
)
from pagedserve.kv.hashing import ROOT_HASH, BlockHasher, hash_block, hash_block_tokens
from pagedserve.kv.kv_blocks import KVCacheBlocks, PrefixCacheStats
from pagedserve.kv.manager import AllocationPolicy, KVCacheManager
from pagedserve.kv.single_type import (
    FullAttentionManager,
    SingleTypeManager,
    SlidingWindowManager,
)
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
