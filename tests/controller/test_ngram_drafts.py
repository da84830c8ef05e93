"""Prompt lookup (``method="ngram"``): the drafts continue the latest earlier occurrence of the
longest suffix that occurs, whatever the order in which the context grew."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.controller.drafts.ngram import NgramProposer


def _brute(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    end = len(tokens)
    for n in range(hi, lo - 1, -1):
        if end < n:
            continue
        starts = [j for j in range(end - n) if tokens[j : j + n] == tokens[end - n :]]
        if starts:
            stop = starts[-1] + n
            return tokens[stop : min(stop + k, end)]
    return []


def test_a_copied_passage_is_proposed() -> None:
    passage = [5, 6, 7, 8, 9, 10, 11, 12]
    p = NgramProposer(2, 4)
    prompt = [1, 2] + passage + [3, 4]
    assert p.propose("a", prompt + passage[:3], len(prompt), 4) == passage[3:7]
    # The output grows by what was accepted; the index follows.
    assert p.propose("a", prompt + passage[:6], len(prompt), 4) == passage[6:8] + [3, 4]
    assert p.propose("b", [1, 2, 3], 3, 4) == []  # another request: its own index
    p.release("a")
    assert p.propose("a", [9, 9], 2, 3) == []  # forgotten: a fresh index


def test_longest_match_wins_then_the_latest() -> None:
    p = NgramProposer(1, 3)
    tokens = [1, 2, 3, 50, 9, 2, 3, 60, 2, 3, 70, 1, 2, 3]
    # "1 2 3" occurs at 0 (-> 50); "2 3" alone occurs later (-> 70) but is shorter.
    assert p.propose("x", tokens, len(tokens), 2) == [50, 9]


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    cuts=st.lists(st.integers(1, 60), max_size=6),
    lo=st.integers(1, 3),
    extra=st.integers(0, 2),
    k=st.integers(1, 6),
)
def test_matches_a_brute_force_search(tokens, cuts, lo, extra, k) -> None:
    p = NgramProposer(lo, lo + extra)
    for cut in sorted({c for c in cuts if c < len(tokens)}) + [len(tokens)]:
        ctx = tokens[:cut]
        assert p.propose("r", ctx, 1, k) == _brute(ctx, lo, lo + extra, k)
