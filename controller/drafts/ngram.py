"""Prompt lookup: the request's last n tokens, found earlier in its own prompt or output,
propose what followed them there.

Each request keeps an index per n, ``n-gram -> end of its latest earlier occurrence``, fed
incrementally (a few dict writes per new token), so a proposal costs a handful of lookups
however long the context is. The longest n that occurs wins; within one n the latest
occurrence wins, which continues the passage being copied rather than an older one.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["NgramProposer"]


class _Index:
    __slots__ = ("by_n", "num_indexed")

    def __init__(self, sizes: range) -> None:
        # by_n[n]: n-gram -> end (exclusive) of its latest occurrence among the indexed ones.
        self.by_n: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.num_indexed = 0
        """n-grams ending at positions < num_indexed are in the index."""


class NgramProposer:
    """``Proposer`` for ``method="ngram"`` (``prompt_lookup_min`` .. ``prompt_lookup_max``)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.sizes = range(prompt_lookup_max, prompt_lookup_min - 1, -1)  # longest first
        self._index: dict[str, _Index] = {}

    def propose(
        self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, max_drafts: int
    ) -> list[int]:
        index = self._index.get(request_id)
        if index is None:
            index = self._index[request_id] = _Index(self.sizes)
        end = len(token_ids)
        # Index every n-gram ending before the current end: the suffix itself must not find
        # its own occurrence.
        for stop in range(index.num_indexed + 1, end):
            for n, table in index.by_n.items():
                if stop >= n:
                    table[tuple(token_ids[stop - n : stop])] = stop
        index.num_indexed = max(index.num_indexed, end - 1)
        for n, table in index.by_n.items():
            if end < n:
                continue
            found = table.get(tuple(token_ids[end - n :]))
            if found is not None:
                return list(token_ids[found : min(found + max_drafts, end)])
        return []

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)
