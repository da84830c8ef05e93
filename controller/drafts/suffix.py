"""Suffix decoding (the idea of Arctic Inference's suffix decoding, vLLM's ``method="suffix"``):
drafts read off counted suffix tries of this request's context and of recent requests' outputs.

A ``SuffixTree`` counts every substring of at most ``max_tree_depth`` tokens of the sequences
put into it, as a trie. Each live request has one over its prompt and outputs; one global tree
holds the outputs of the last ``max_cached_requests`` requests that produced any, fed as they
are generated so concurrent requests see each other's text, and kept after ``release`` until
the request is evicted (oldest first: its counts taken back out, emptied nodes pruned).

A substring seen once has a single continuation, so below the first node of count 1 the trie is
a chain that the sequence itself spells: such a node is a *tail* that points into its sequence
instead of holding children, and is split one level when a second occurrence reaches it. Text
that repeats nothing then costs a node or two per token instead of ``max_tree_depth``. Text
that repeats other text still costs up to ``max_tree_depth`` nodes a token, which is what
bounds ``max_cached_requests``.

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
from collections.abc import Iterable, Sequence
from math import floor

__all__ = ["Stream", "SuffixNode", "SuffixProposer", "SuffixTree"]


class Stream:
    """A sequence going into a ``SuffixTree``: its tokens so far and its *active* list.

    ``active[k]`` is the node of the last ``k`` tokens (``active[0]`` the root) for every
    ``k < max_depth`` whose suffix had occurred before in the tree; longer suffixes are each
    inside the tail made for them, growing with the sequence at no cost. ``active`` is None
    once the sequence is complete (released or evicted).
    """

    __slots__ = ("active", "tokens")

    def __init__(self, root: SuffixNode) -> None:
        self.tokens = array("q")  # 8 bytes a token where a list of ints costs 36
        self.active: list[SuffixNode] | None = [root]


# ``children`` of every node with at most one child (which is then ``best``): shared and always
# empty. Most nodes are tails or links of a chain, and a dict each would triple their size.
_NO_CHILDREN: dict[int, SuffixNode] = {}


class SuffixNode:
    """One substring: the path of tokens from the root to here."""

    __slots__ = ("best", "children", "count", "end", "src", "token", "total")

    def __init__(
        self, token: int, count: int = 0, src: Stream | None = None, end: int = 0
    ) -> None:
        self.token = token
        """The last token of the path (-1 at the root)."""
        self.count = count
        """Occurrences of the path in the sequences put into the tree."""
        self.total = 0
        """The explicit children's counts summed: occurrences followed by a token (0 at a
        tail, whose one continuation is implicit)."""
        self.children = _NO_CHILDREN
        """All the children once there are two, else ``_NO_CHILDREN``."""
        self.best: SuffixNode | None = None
        """A child with the highest count, None when there are none, ``_STALE`` when an
        eviction left it to be found again on the next read. Ties keep the child that reached
        the count first (after an eviction, the first made). At the root it is only a child
        (or None), kept for the lookup shortcut: no match ends there."""
        self.src = src
        """At a tail (count 1): the sequence of its one occurrence, whose tokens from ``end``
        on are the implicit chain below it (as deep as the tree allows). None elsewhere."""
        self.end = end


# A ``best`` to be recomputed: its count beats every real one, so increments leave it alone,
# and its token matches none.
_STALE = SuffixNode(-2, 1 << 62)


def _child(node: SuffixNode, token: int) -> SuffixNode | None:
    best = node.best
    if best is not None and best.token == token:
        return best  # the only child, or the likeliest one
    return node.children.get(token)


def _children(node: SuffixNode) -> Iterable[SuffixNode]:
    if node.children is not _NO_CHILDREN:
        return node.children.values()
    return () if node.best is None else (node.best,)


def _best(node: SuffixNode) -> SuffixNode | None:
    best = node.best
    if best is _STALE:
        best = node.best = max(node.children.values(), key=_count)
    return best


def _count(node: SuffixNode) -> int:
    return node.count


class SuffixTree:
    """The substrings of at most ``max_depth`` tokens of the sequences put in, counted."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = SuffixNode(-1)
        self.root.children = {}  # it soon has many

    def stream(self) -> Stream:
        """A new, empty sequence to ``extend``."""
        return Stream(self.root)

    def extend(self, stream: Stream, token: int) -> None:
        """Append ``token`` to the stream and count it after each of its active suffixes:
        O(len(active)), at most ``max_depth``."""
        active = stream.active
        assert active is not None, "the stream is complete"
        stream.tokens.append(token)
        end = len(stream.tokens)
        nxt = [self.root]
        for depth, node in enumerate(active, 1):  # depth: the child's
            node.total += 1
            best = node.best
            if best is not None and best.token == token:
                child = best
            else:
                child = node.children.get(token)
                if child is None:
                    # The first occurrence of this suffix: a tail on the rest of the stream.
                    child = SuffixNode(token, 1, stream, end)
                    if node.children is not _NO_CHILDREN:
                        node.children[token] = child
                    elif best is not None:
                        node.children = {best.token: best, token: child}
                    if best is None:
                        node.best = child
                    continue
            child.count += 1
            if child.src is not None:
                self._split(child, depth)
            if best is None or child.count > best.count:
                node.best = child
            if depth < self.max_depth:
                nxt.append(child)
        stream.active = nxt

    def _split(self, tail: SuffixNode, depth: int) -> None:
        # A second occurrence reached the tail: its first implicit child (where the depth and
        # its sequence have one) becomes a tail of its own.
        src, end = tail.src, tail.end
        assert src is not None
        tail.src = None
        if depth >= self.max_depth:
            return
        if end < len(src.tokens):
            tail.best = SuffixNode(src.tokens[end], 1, src, end + 1)
            tail.total = 1
        elif src.active is not None and len(src.active) == depth:
            # The tail ends where its growing sequence ends now (another sequence of the
            # global tree caught up with it): the next token of that sequence must reach
            # this node, so it joins the active list. The same step splits the shorter
            # suffixes first, which keeps the list one node per depth.
            src.active.append(tail)

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back a sequence that went in whole through ``extend``: for each start, the
        counts along ``tokens[start:start + max_depth]``."""
        root = self.root
        for start in range(len(tokens)):
            node = root
            for token in tokens[start : start + self.max_depth]:
                child = _child(node, token)
                assert child is not None
                child.count -= 1
                node.total -= 1
                if child.count == 0:
                    # A child counts a subset of its parent's occurrences (and a tail counts
                    # just this one), so the rest of this walk goes with it.
                    self._unlink(node, child)
                    break
                if node.best is child and node.children is not _NO_CHILDREN:
                    # Another child may lead now. A scan here would cost the width of
                    # nodes like the one after a common token at every eviction.
                    node.best = _STALE if node is not root else None
                node = child

    def _unlink(self, node: SuffixNode, child: SuffixNode) -> None:
        if node.children is _NO_CHILDREN:
            node.best = None  # it was the only child
            return
        del node.children[child.token]
        if node.best is child or node.best is _STALE:
            node.best = _STALE if node.children and node is not self.root else None

    def match(self, tokens: Sequence[int], m: int) -> tuple[SuffixNode, int] | None:
        """Where the last ``m`` tokens (``m < max_depth``) end in the tree, if they occur there
        followed by something: a node and how many tokens of its tail chain the match runs
        into (0 at an explicit node); None otherwise."""
        node = self.root
        n = len(tokens)
        for i in range(n - m, n):
            src = node.src
            if src is not None:
                end = node.end + n - i
                # The chain must hold the rest of the match and one token after it.
                if end < len(src.tokens) and src.tokens[node.end : end].tolist() == list(
                    tokens[i:n]
                ):
                    return node, n - i
                return None
            child = _child(node, tokens[i])
            if child is None:
                return None
            node = child
        if node.src is not None:
            return (node, 0) if node.end < len(node.src.tokens) else None
        return (node, 0) if node.total else None

    def counts(self) -> dict[tuple[int, ...], int]:
        """Every substring in the tree with its count, tails unrolled (for checks and tests)."""
        out: dict[tuple[int, ...], int] = {}
        stack = [((child.token,), child) for child in _children(self.root)]
        while stack:
            path, node = stack.pop()
            out[path] = node.count
            if node.src is not None:
                rest = node.src.tokens[node.end : node.end + self.max_depth - len(path)]
                for j in range(1, len(rest) + 1):
                    out[path + tuple(rest[:j])] = 1
            stack.extend((path + (child.token,), child) for child in _children(node))
        return out

    def check_integrity(self) -> None:
        """Raise AssertionError unless every count, total, best pointer and tail agrees."""
        assert not _NO_CHILDREN
        stack: list[tuple[tuple[int, ...], SuffixNode]] = [((), self.root)]
        while stack:
            path, node = stack.pop()
            kids = list(_children(node))
            assert len(path) <= self.max_depth and node.total == sum(c.count for c in kids), path
            assert all(c.token == tok for tok, c in node.children.items()), path
            stack.extend((path + (child.token,), child) for child in kids)
            if not path:
                assert node.best is None or node.children[node.best.token] is node.best
                continue  # the root counts nothing itself and its best only has to be a child
            if node.src is not None:
                assert node.count == 1 and node.best is None and node.total == 0, path
                start = node.end - len(path)
                assert start >= 0 and tuple(node.src.tokens[start : node.end]) == path, path
                continue
            assert 0 < node.count and node.total <= node.count, path
            assert node.best is not _STALE or node.children, path
            if node.best is not _STALE:
                top = max((c.count for c in kids), default=None)
                assert (node.best is None) == (top is None), path
                assert node.best is None or (
                    node.best.count == top and node.best in kids
                ), path


def _greedy(node: SuffixNode, skip: int, cap: int, min_prob: float) -> tuple[list[int], float]:
    """The draft after a match that ends at ``node`` (``skip`` tokens into its tail chain):
    the most frequent child while the running probability holds, and the draft's score (the
    running probabilities summed). ``cap`` keeps it within the tree's depth."""
    draft: list[int] = []
    prob, score = 1.0, 0.0
    while len(draft) < cap:
        src = node.src
        if src is not None:
            # One occurrence: each token of its chain follows the last with probability 1.
            start = node.end + skip
            take = min(cap - len(draft), len(src.tokens) - start)
            if take > 0:
                draft.extend(src.tokens[start : start + take])
                score += prob * take
            break
        child = _best(node)
        if child is None:
            break
        prob *= child.count / node.total
        if prob < min_prob:
            break
        draft.append(child.token)
        score += prob
        node = child
    return draft, score


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
                draft, score = _greedy(active[m], 0, cap, min_prob)
                if score > best_score:
                    best, best_score = draft, score
            if m <= lo and (at := found.get(m) or self.global_tree.match(token_ids, m)):
                draft, score = _greedy(at[0], at[1], cap, min_prob)
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
