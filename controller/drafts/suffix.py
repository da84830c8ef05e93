"""Suffix decoding (the idea of Arctic Inference's suffix decoding, vLLM's ``method="suffix"``):
drafts read off counted suffix tries of this request's context and of recent requests' outputs.

A ``SuffixTree`` counts every substring of at most ``max_tree_depth`` tokens of the sequences
put into it, as a trie. Each live request has one over its prompt and outputs; one global tree
holds the outputs of the last ``max_cached_requests`` requests that produced any, fed as they
are generated so concurrent requests see each other's text, and kept after ``release`` until
the request is evicted (oldest first: its counts taken back out, emptied nodes pruned).

The tries themselves (compact chains for text seen once) are ``drafts.suffix_tree``.

A proposal matches a suffix of the context (``m`` tokens, ``1 <= m < max_tree_depth``), then
walks down from its node taking the most frequent child while the running product of
``child.count / node.total`` stays at or above ``min_token_prob``, for at most
``min(max_drafts, floor(max_spec_factor * m + max_spec_offset), max_tree_depth - m)`` tokens.
``node.total`` counts the occurrences that are followed by a token; the plain ``node.count``
would also count the occurrence being matched (the context's own end, which has no
continuation yet) and halve the estimate given by a single earlier occurrence. The score of a
draft is the sum of the running products (its expected number of accepted tokens), and the
proposal is the best score over both trees and every match length. Every length is tried, not
only the longest, because a match of ``m`` tokens leaves only ``max_tree_depth - m`` levels
below it: while a long passage is being copied the longest match sits at the bottom of the trie
and could draft one token where a middle-length one drafts ``max_tree_depth / 2``. Lengths go
in decreasing order of their cap, and the search stops once no cap can beat the best score.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from math import floor

from pagedserve.controller.drafts.suffix_tree import (
    Stream,
    SuffixNode,
    SuffixTree,
    greedy_draft,
)

__all__ = ["SuffixProposer"]


class _Live:
    """One running request: its own tree over prompt and outputs, and its outputs' stream in
    the global tree (None until it has outputs, or without a global tree)."""

    __slots__ = ("output", "stream", "tree")

    def __init__(self, max_depth: int) -> None:
        self.tree = SuffixTree(max_depth)
        self.stream = self.tree.stream()
        self.output: Stream | None = None


class SuffixProposer:
    """``Proposer`` for ``method="suffix"``; the arguments mirror vLLM's
    ``suffix_decoding_*`` options (``max_spec_offset`` is Arctic's)."""

    def __init__(
        self,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        max_spec_offset: float = 0.0,
    ) -> None:
        if max_tree_depth < 2:
            raise ValueError(f"max_tree_depth must be at least 2, got {max_tree_depth}")
        if max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be >= 0, got {max_cached_requests}")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_spec_offset = max_spec_offset
        self.global_tree = SuffixTree(max_tree_depth)
        self._live: dict[str, _Live] = {}
        # Insertion order is eviction order. The keys are serial numbers, not request ids: an
        # id may come back after release while its old output is still cached.
        self._cached: OrderedDict[int, Stream] = OrderedDict()
        self._serial = 0
        self._orders: dict[int, list[tuple[int, int]]] = {}

    def propose(
        self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, max_drafts: int
    ) -> list[int]:
        live = self._live.get(request_id)
        if live is None:
            live = self._live[request_id] = _Live(self.max_tree_depth)
        self._ingest(live, token_ids, num_prompt_tokens)
        depth, min_prob = self.max_tree_depth, self.min_token_prob
        active = live.stream.active
        assert active is not None
        # Whether the last m tokens occur followed by something holds for every m up to some
        # longest one (an occurrence of them with a next token contains one of the last m - 1
        # with the same next token), so that longest one is a binary search. In the request's
        # own tree they are the suffixes that occurred before: the active list.
        found: dict[int, tuple[SuffixNode, int]] = {}
        lo, hi = 0, min(depth - 1, len(token_ids))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            at = self.global_tree.match(token_ids, mid)
            if at is None:
                hi = mid - 1
            else:
                found[mid] = at
                lo = mid
        longest = max(lo, len(active) - 1)
        best: list[int] = []
        best_score = 0.0
        for m, cap in self._order(max_drafts):
            if cap <= best_score:
                break  # a score is at most its draft's length
            if m > longest:
                continue
            if m < len(active):
                draft, score = greedy_draft(active[m], 0, cap, min_prob)
                if score > best_score:
                    best, best_score = draft, score
            if m <= lo and (at := found.get(m) or self.global_tree.match(token_ids, m)):
                draft, score = greedy_draft(at[0], at[1], cap, min_prob)
                if score > best_score:
                    best, best_score = draft, score
        return best

    def release(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        # Tails point back at their stream: without the active list the tree is no longer a
        # cycle, and reference counting frees it now rather than at the next full collection.
        live.stream.active = None
        if live.output is not None:
            live.output.active = None  # complete: its tokens stay for the global tree

    def request_tree(self, request_id: str) -> SuffixTree | None:
        """The live request's own tree (for checks and tests)."""
        live = self._live.get(request_id)
        return None if live is None else live.tree

    def _ingest(self, live: _Live, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        seen = len(live.stream.tokens)
        if seen == len(token_ids):
            return
        for token in token_ids[seen:]:
            live.tree.extend(live.stream, token)
        start = max(seen, num_prompt_tokens)
        if start >= len(token_ids) or self.max_cached_requests == 0:
            return
        out = live.output
        if out is None:
            out = live.output = self._cache(self.global_tree.stream())
        if out.active is None:
            return  # evicted while still running: the rest of it stays out
        for token in token_ids[start:]:
            self.global_tree.extend(out, token)

    def _cache(self, out: Stream) -> Stream:
        self._cached[self._serial] = out
        self._serial += 1
        while len(self._cached) > self.max_cached_requests:
            _, old = self._cached.popitem(last=False)
            self.global_tree.remove(old.tokens)
            old.active, old.tokens = None, array("q")
        return out

    def _order(self, max_drafts: int) -> list[tuple[int, int]]:
        """``(m, cap)`` for every match length with a positive cap, largest cap first (the
        longer match first among equal caps)."""
        order = self._orders.get(max_drafts)
        if order is None:
            depth = self.max_tree_depth
            caps = [
                # + 1e-9: 0.29 * 100 is 28.999999999999996 in floats and must give 29.
                (m, min(max_drafts, depth - m,
                        floor(self.max_spec_factor * m + self.max_spec_offset + 1e-9)))
                for m in range(1, depth)
            ]
            order = sorted(((m, c) for m, c in caps if c > 0), key=lambda mc: (-mc[1], -mc[0]))
            self._orders[max_drafts] = order
        return order
