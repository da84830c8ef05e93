"""Suffix drafts: what the tries count equals a brute-force count of the substrings (built in
one go or token by token, before and after evictions), and every draft continues an earlier
occurrence of a suffix of the context, within the length caps."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from math import floor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.controller.drafts.suffix import SuffixProposer

P = list(range(100, 120))  # a passage of distinct tokens
X = list(range(200, 210))  # filler that occurs once


def substring_counts(seqs: Sequence[Sequence[int]], depth: int) -> Counter[tuple[int, ...]]:
    counts: Counter[tuple[int, ...]] = Counter()
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(i + depth, len(seq)) + 1):
                counts[tuple(seq[i:j])] += 1
    return counts


def cap(m: int, max_drafts: int, depth: int, factor: float, offset: float) -> int:
    return min(max_drafts, depth - m, floor(factor * m + offset + 1e-9))


def occurs(needle: Sequence[int], hay: Sequence[int]) -> bool:
    k = len(needle)
    return any(list(hay[i : i + k]) == list(needle) for i in range(len(hay) - k + 1))


def feed(
    p: SuffixProposer, rid: str, prompt: list[int], outputs: list[int], max_drafts: int,
    start: int = 0,
) -> list[int]:
    """Decode ``outputs[start:]`` (after the ``start`` already decoded) one token at a time,
    proposing at each step; the last proposal."""
    tokens = prompt + outputs[:start]
    draft = p.propose(rid, tokens, len(prompt), max_drafts)
    for t in outputs[start:]:
        tokens.append(t)
        draft = p.propose(rid, tokens, len(prompt), max_drafts)
    return draft


@pytest.mark.parametrize(
    ("k", "max_drafts", "factor", "offset"),
    [(1, 5, 1.0, 0.0), (3, 5, 1.0, 0.0), (8, 5, 1.0, 0.0), (12, 16, 1.0, 0.0),
     (18, 16, 1.0, 0.0), (20, 8, 1.0, 0.0), (6, 8, 0.5, 0.0), (6, 8, 0.5, 1.0), (2, 8, 3.0, 0.0)],
)
def test_a_repeated_passage_is_proposed_from_its_earlier_occurrence(k, max_drafts, factor, offset):
    p = SuffixProposer(max_spec_factor=factor, max_spec_offset=offset)
    draft = p.propose("a", P + X + P[:k], 5, max_drafts)
    # Every suffix that occurred before is a suffix of P[:k] and continues as P + X did; the
    # best cap over those match lengths sets the length.
    length = max(cap(m, max_drafts, 24, factor, offset) for m in range(1, k + 1))
    assert draft == (P + X)[k : k + length]


def test_draft_length_follows_match_length_and_max_drafts():
    p = SuffixProposer(max_spec_factor=0.5)
    assert p.propose("a", P + X + P[:6], 5, 8) == P[6:9]  # 0.5 * 6 tokens matched
    assert p.propose("b", P + X + P[:14], 5, 8) == (P + X)[14:21]
    assert p.propose("b", P + X + P[:14], 5, 4) == P[14:18]  # max_drafts
    q = SuffixProposer(max_tree_depth=8)
    # Depth 8: a match of m tokens leaves 8 - m levels, so the best is m = 4, 4 drafts.
    assert q.propose("a", P + X + P[:10], 5, 8) == P[10:14]


def test_the_token_at_the_current_position_is_not_proposed_again():
    p = SuffixProposer()
    assert p.propose("a", [5, 6, 7, 5], 4, 4) == [6]  # one token matched: one draft
    assert p.propose("a", [5, 6, 7, 5, 6], 4, 4) == [7, 5]
    assert p.propose("b", [3, 3, 3, 3], 4, 4) == [3, 3]  # a run continues itself
    assert p.propose("c", [1, 2, 3, 4], 4, 4) == []


def test_min_token_prob_stops_where_the_counts_disagree():
    # "7 1 2 3" is followed by 4 twice and by 5 once: 4 has probability 2/3.
    ctx = [7, 1, 2, 3, 4] * 2 + [7, 1, 2, 3, 5, 7, 1]
    assert SuffixProposer(max_spec_factor=10, min_token_prob=0.7).propose("a", ctx, 3, 4) == [2, 3]
    assert SuffixProposer(max_spec_factor=10, min_token_prob=0.5).propose("a", ctx, 3, 4) == [
        2, 3, 4, 7]
    # The product runs on: 2/3 at the first 4, then "7 1 2 3 4 7 1 2 3" goes on once as 4 and
    # once as 5, a tie that the first to be seen (4) wins at 2/3 * 1/2.
    drafts = [SuffixProposer(max_spec_factor=10, min_token_prob=prob).propose("a", ctx, 3, 8)
              for prob in (0.3, 0.4)]
    assert drafts == [[2, 3, 4, 7, 1, 2, 3, 4], [2, 3, 4, 7, 1, 2, 3]]


def test_a_tie_goes_to_the_continuation_that_reached_the_count_first():
    # After 9: 1 twice and 2 twice, 2 got there first (depth 2: one-token matches only).
    assert SuffixProposer(max_tree_depth=2).propose("a", [9, 1, 9, 2, 9, 2, 9, 1, 9], 1, 4) == [2]


def test_outputs_of_other_requests_give_drafts_while_running_and_after_release():
    out = list(range(300, 330))
    p = SuffixProposer(max_cached_requests=4)
    feed(p, "a", [1, 2, 3], out[:10], 4)  # still running
    assert feed(p, "b", [50, 51], out[:4], 4) == out[4:8]
    feed(p, "a", [1, 2, 3], out, 4, start=10)
    p.release("a")
    assert p.request_tree("a") is None
    assert feed(p, "c", [60], out[:6], 8) == out[6:12]
    # Prompts stay out of the global tree: "d" repeating a's prompt finds nothing there.
    assert p.propose("d", [1, 2], 2, 4) == []
    assert (1, 2) not in p.global_tree.counts()


def test_requests_writing_the_same_text_in_step_are_all_counted():
    # Each token of "b" reaches the end of what "a" has written so far, and the other way
    # round: the counts must still cover both outputs whole.
    out = [5, 6, 7, 5, 6, 8, 9]
    p = SuffixProposer(max_tree_depth=4)
    for i in range(1, len(out) + 1):
        for rid in ("a", "b"):
            p.propose(rid, [0] + out[:i], 1, 3)
            p.global_tree.check_integrity()
    assert p.global_tree.counts() == substring_counts([out, out], 4)
    assert p.propose("c", [1, 5, 6], 1, 3) == [7, 5]  # depth 4: 2 matched, 2 drafted


def test_a_reused_request_id_starts_afresh_and_keeps_the_old_output_cached():
    p = SuffixProposer(max_cached_requests=2)
    feed(p, "a", [1], [10, 11, 12, 13], 2)
    p.release("a")
    assert p.propose("a", [10, 11], 0, 2) == [12, 13]  # from the global tree
    assert p.request_tree("a").counts() == substring_counts([[10, 11]], 24)


def test_eviction_takes_back_exactly_the_evicted_outputs():
    outs = [[1, 2, 3, 4, 5, 1, 2, 3], [2, 3, 4, 9, 9, 9, 2, 3], [3, 4, 5, 1, 2, 7],
            [1, 2, 3, 4, 5, 6], [9, 9, 2, 3, 4]]
    p = SuffixProposer(max_tree_depth=5, max_cached_requests=2)
    for i, out in enumerate(outs):
        feed(p, f"r{i}", [0], out, 3)
        p.release(f"r{i}")
        p.global_tree.check_integrity()
        assert p.global_tree.counts() == substring_counts(outs[max(0, i - 1) : i + 1], 5)


def test_after_an_eviction_the_likeliest_continuation_is_found_again():
    p = SuffixProposer(max_tree_depth=3, max_cached_requests=3)
    for i, out in enumerate([[1, 2, 1, 2, 1, 2], [1, 3, 1, 3], [1, 2], [7]]):
        feed(p, f"r{i}", [0], out, 1)  # the last evicts the first
    # After 1: 2 went from 4 to 1 time, 3 stayed at 2.
    assert p.propose("x", [9, 1], 2, 1) == [3]  # (all prompt: nothing more evicted)
    p.global_tree.check_integrity()


def test_a_request_evicted_while_running_stops_adding_its_outputs():
    p = SuffixProposer(max_tree_depth=4, max_cached_requests=1)
    feed(p, "a", [0], [1, 2, 3], 2)
    feed(p, "b", [0], [4, 5], 2)  # evicts a, still running
    feed(p, "a", [0], [1, 2, 3, 6, 7], 2, start=3)
    p.global_tree.check_integrity()
    assert p.global_tree.counts() == substring_counts([[4, 5]], 4)
    assert SuffixProposer(max_cached_requests=0).propose("a", [0, 1, 0], 1, 2) == [1]


tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=40)
params_st = st.fixed_dictionaries({
    "max_tree_depth": st.integers(2, 7),
    "max_spec_factor": st.sampled_from([0.5, 1.0, 2.0, 4.0]),
    "max_spec_offset": st.sampled_from([-1.0, 0.0, 1.0]),
    "min_token_prob": st.sampled_from([0.0, 0.1, 0.4, 0.8]),
})


def is_real_continuation(draft: list[int], context: list[int], sources: list[list[int]],
                         max_drafts: int, params: dict) -> bool:
    """Some suffix of the context, followed by the draft, occurs in a source, and the draft
    fits that suffix's caps."""
    depth = params["max_tree_depth"]
    return any(
        len(draft) <= cap(m, max_drafts, depth, params["max_spec_factor"],
                          params["max_spec_offset"])
        and any(occurs(context[-m:] + draft, src) for src in sources)
        for m in range(1, min(depth - 1, len(context)) + 1)
    )


@settings(max_examples=300, deadline=None)
@given(tokens=tokens_st, cuts=st.lists(st.integers(1, 40), max_size=8),
       num_prompt=st.integers(0, 40), max_drafts=st.integers(1, 6), params=params_st)
def test_drafts_continue_real_occurrences_and_ingestion_is_incremental(
    tokens, cuts, num_prompt, max_drafts, params
):
    num_prompt = min(num_prompt, len(tokens))
    p = SuffixProposer(**params)
    for end in sorted({min(max(c, num_prompt, 1), len(tokens)) for c in cuts} | {len(tokens)}):
        ctx = tokens[:end]
        draft = p.propose("a", ctx, num_prompt, max_drafts)
        assert not draft or is_real_continuation(draft, ctx, [ctx], max_drafts, params)
    depth = params["max_tree_depth"]
    tree = p.request_tree("a")
    tree.check_integrity()
    p.global_tree.check_integrity()
    assert tree.counts() == substring_counts([tokens], depth)
    assert p.global_tree.counts() == substring_counts([tokens[num_prompt:]], depth)
    scratch = SuffixProposer(**params)
    assert scratch.propose("a", tokens, num_prompt, max_drafts) == draft
    assert scratch.request_tree("a").counts() == tree.counts()


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3), max_size=6),
                           st.booleans()), max_size=25),
    max_cached=st.integers(0, 3), max_drafts=st.integers(1, 5), params=params_st,
)
def test_the_global_tree_counts_the_retained_outputs(ops, max_cached, max_drafts, params):
    depth = params["max_tree_depth"]
    p = SuffixProposer(max_cached_requests=max_cached, **params)
    contexts: dict[str, list[int]] = {}
    entry: dict[str, int | None] = {}  # request id -> its key in the model's cache
    cached: OrderedDict[int, list[int]] = OrderedDict()  # the model of the global tree
    prompt_len = 2
    for serial, (who, new, release) in enumerate(ops):
        rid = f"r{who}"
        if rid not in contexts:
            contexts[rid], entry[rid] = [who, who], None
        ctx = contexts[rid]
        ctx.extend(new)
        if new and max_cached:
            if entry[rid] is None:
                entry[rid] = serial
                cached[serial] = []
                while len(cached) > max_cached:
                    cached.popitem(last=False)
            if entry[rid] in cached:
                cached[entry[rid]].extend(new)
        draft = p.propose(rid, ctx, prompt_len, max_drafts)
        sources = [ctx, *cached.values()]
        assert not draft or is_real_continuation(draft, ctx, sources, max_drafts, params)
        p.global_tree.check_integrity()
        assert p.global_tree.counts() == substring_counts(list(cached.values()), depth)
        if release:
            p.release(rid)
            del contexts[rid]


def reference_draft(ctx: list[int], max_drafts: int, params: dict) -> list[int]:
    """The request-tree proposal from scratch, by scanning ``ctx`` for every count. Ties go to
    the token whose count reached the top first, as in the trie; past a continuation seen once
    the draft follows that one occurrence (probability 1 a token, added up in one go as the
    trie does, so that the float scores compare equal)."""
    depth, n = params["max_tree_depth"], len(ctx)
    caps = [(m, cap(m, max_drafts, depth, params["max_spec_factor"], params["max_spec_offset"]))
            for m in range(1, depth)]
    best: list[int] = []
    best_score = 0.0
    for m, c in sorted(((m, c) for m, c in caps if c > 0), key=lambda mc: (-mc[1], -mc[0])):
        if c <= best_score:
            break
        if m > n:
            continue
        path, draft, prob, score = ctx[n - m :], [], 1.0, 0.0
        while len(draft) < c and len(path) < depth:
            k = len(path)
            nexts = [j for j in range(k, n) if ctx[j - k : j] == path]  # followed by ctx[j]
            if not nexts:
                break
            count = Counter(ctx[j] for j in nexts)
            top = max(count.values())
            token = min((t for t in count if count[t] == top),
                        key=lambda t: [j for j in nexts if ctx[j] == t][top - 1])
            prob *= top / len(nexts)
            if prob < params["min_token_prob"]:
                break
            draft.append(token)
            score += prob
            path = path + [token]
            if top == 1:
                after = next(j for j in nexts if ctx[j] == token) + 1
                rest = ctx[after : after + min(c - len(draft), depth - len(path))]
                draft += rest
                score += prob * len(rest)
                break
        if score > best_score:
            best, best_score = draft, score
    return best


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=50),
       max_drafts=st.integers(1, 8), params=params_st)
def test_the_request_tree_proposes_what_a_brute_force_count_gives(tokens, max_drafts, params):
    p = SuffixProposer(max_cached_requests=0, **params)
    for end in range(1, len(tokens) + 1):
        ctx = tokens[:end]
        assert p.propose("a", ctx, 1, max_drafts) == reference_draft(ctx, max_drafts, params)
