"""Counted suffix tries for suffix decoding (``drafts.suffix``): every substring of at most
``max_tree_depth`` tokens of the sequences put in, with how often each occurred, and the greedy
walk that reads a draft off a matched node.

A substring seen once has a single continuation, so below the first node of count 1 the trie is
a chain that the sequence itself spells: such a node is a *tail* that points into its sequence
instead of holding children, and is split one level when a second occurrence reaches it. Text
that repeats nothing then costs a node or two per token instead of ``max_tree_depth``. Text
that repeats other text still costs up to ``max_tree_depth`` nodes a token, which is what
bounds ``max_cached_requests``.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

__all__ = ["Stream", "SuffixNode", "SuffixTree", "greedy_draft"]


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


def greedy_draft(node: SuffixNode, skip: int, cap: int, min_prob: float) -> tuple[list[int], float]:
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
