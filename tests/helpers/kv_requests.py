"""A minimal request satisfying :class:`pagedserve.kv.request.KVRequest`, for the KV tests.

It shows the one thing a request must do for the KV manager, which is to extend its block
hashes whenever tokens are appended.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedserve.kv.hashing import BlockHasher

__all__ = ["SimpleRequest"]


class SimpleRequest:
    __slots__ = (
        "request_id",
        "all_token_ids",
        "num_computed_tokens",
        "block_hashes",
        "cache_salt",
        "_hasher",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        hasher: BlockHasher,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        self.cache_salt = cache_salt
        self._hasher = hasher
        hasher.extend(self.block_hashes, self.all_token_ids, cache_salt)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_token_ids(self, token_ids: Iterable[int]) -> None:
        """Append generated tokens and hash any block they complete."""
        self.all_token_ids.extend(token_ids)
        self._hasher.extend(self.block_hashes, self.all_token_ids, self.cache_salt)

    def append_token_id(self, token_id: int) -> None:
        toks = self.all_token_ids
        toks.append(token_id)
        # Only a token that completes a block can produce a hash: skip the call otherwise.
        if len(toks) % self._hasher.block_size == 0:
            self._hasher.extend(self.block_hashes, toks, self.cache_salt)

    def fork(self, child_id: str) -> SimpleRequest:
        """A child with the same tokens, progress and hashes (for ``KVCacheManager.fork``)."""
        child = SimpleRequest.__new__(SimpleRequest)
        child.request_id = child_id
        child.all_token_ids = list(self.all_token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child.cache_salt = self.cache_salt
        child._hasher = self._hasher
        return child

    def __repr__(self) -> str:
        return (
            f"SimpleRequest({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
