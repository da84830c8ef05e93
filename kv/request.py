"""What the KV manager needs from a request (the scheduler's Request satisfies it)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["KVRequest"]


@runtime_checkable
class KVRequest(Protocol):
    """The request view the KV manager reads. The manager never writes to a request.

    Ownership: the scheduler owns the request and keeps these fields current.

    * ``all_token_ids``: prompt followed by every output token so far (a growing list).
    * ``num_tokens``: ``len(all_token_ids)``.
    * ``num_computed_tokens``: tokens whose KV is (or is being) written; the scheduler advances
      it after each scheduled step and resets it to 0 on preemption.
    * ``block_hashes``: chained hashes of every *full* block of ``all_token_ids``, extended with
      :class:`pagedserve.kv.hashing.BlockHasher` whenever tokens are appended (at the manager's
      block size, ``KVCacheManager.block_size``).
    * ``cache_salt``: tenant isolation for the prefix cache, or None.
    """

    @property
    def request_id(self) -> str: ...

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> list[bytes]: ...

    @property
    def cache_salt(self) -> str | None: ...

