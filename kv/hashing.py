"""Chained, domain-separated block hashes for the prefix cache.

``H_i = sha256(msgpack([H_{i-1}, tokens_i, extra_keys_i]))`` with ``H_{-1} = ROOT_HASH``. Because
each hash covers its parent, ``H_i`` fingerprints the whole prefix ``[0, (i+1)*B)`` and a lookup
can stop at the first miss. Design choices:

* msgpack with ``use_bin_type`` is a canonical encoding (ints, bytes and str have one encoding
  each), unlike pickle, so every process and language computes the same bytes.
* ``ROOT_HASH`` is a fixed constant, never Python's ``hash()`` or a random seed, so hashes agree
  across controller restarts and nodes.
* Extra keys are tagged tuples (``("salt", s)``, ``("mm", id, offset)``, ...): untagged keys let
  a LoRA named "x" collide with a cache salt "x".
* The cache salt goes on the first block only; the chain carries it into every later block.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

__all__ = ["ROOT_HASH", "BlockHasher", "ExtraKeysFn", "hash_block", "hash_block_tokens"]

BlockHash = bytes

ROOT_HASH: BlockHash = hashlib.sha256(b"pagedserve/kv/block-hash/v1").digest()

# (block_index, start_token, end_token) -> tagged extra keys for that block, or None.
ExtraKeysFn = Callable[[int, int, int], "Sequence[tuple[Any, ...]] | None"]

_packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack
_sha256 = hashlib.sha256


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[tuple[Any, ...]] | None = None,
) -> BlockHash:
    """Hash one full block given its parent's hash (``None`` for the first block)."""
    if parent is None:
        parent = ROOT_HASH
    keys = [list(k) for k in extra_keys] if extra_keys else None
    return _sha256(_packb([parent, list(token_ids), keys])).digest()


def hash_block_tokens(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    extra_keys_fn: ExtraKeysFn | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (a reference/test helper)."""
    out: list[BlockHash] = []
    BlockHasher(block_size, extra_keys_fn).extend(out, token_ids, cache_salt)
    return out


class BlockHasher:
    """Incremental hasher that a request calls whenever tokens are appended.

    ``extend(hashes, token_ids, salt)`` appends the hashes of the blocks that became full since
    the last call, i.e. it starts at ``len(hashes) * block_size`` and chains from ``hashes[-1]``.
    Each block is therefore hashed exactly once over the request's life, generated tokens
    included, so a preempted request finds its own blocks again on resume.

    ``block_size`` must be the KV manager's (virtual) block size, ``KVCacheManager.block_size``.
    """

    __slots__ = ("block_size", "extra_keys_fn")

    def __init__(self, block_size: int, extra_keys_fn: ExtraKeysFn | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.extra_keys_fn = extra_keys_fn

    def extend(
        self, hashes: list[BlockHash], token_ids: Sequence[int], cache_salt: str | None = None
    ) -> int:
        """Append hashes of newly full blocks to ``hashes`` in place; return how many."""
        bs = self.block_size
        start_block = len(hashes)
        end_block = len(token_ids) // bs
        if end_block <= start_block:
            return 0
        fn = self.extra_keys_fn
        parent = hashes[-1] if hashes else ROOT_HASH
        packb, sha = _packb, _sha256
        for i in range(start_block, end_block):
            start = i * bs
            keys: list[list[Any]] | None = None
            if fn is not None:
                extra = fn(i, start, start + bs)
                if extra:
                    keys = [list(k) for k in extra]
            if i == 0 and cache_salt is not None:
                keys = [["salt", cache_salt], *(keys or ())]
            # Slicing a list gives a list, which msgpack packs without a conversion copy.
            chunk = token_ids[start : start + bs]
            parent = sha(packb([parent, chunk, keys])).digest()
            hashes.append(parent)
        return end_block - start_block
