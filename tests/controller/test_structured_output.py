"""Structured outputs in the controller: constraints refused by name before anything is
compiled, compiled grammars cached by their text, and the masks of a step with drafts equal
to the masks the same tokens get one step at a time, the matcher left where it was."""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.controller.errors import InvalidGrammarError
from pagedserve.controller.grammar_matcher import CLOSING_SLACK
from pagedserve.controller.structured_output import GrammarGate, grammar_text
from pagedserve.messages import SamplingParamsError
from pagedserve.messages import StructuredOutputsParams as Constraint


@pytest.mark.parametrize("kw", [
    {}, {"json": {"type": "object"}, "regex": "a+"}, {"choice": []}, {"choice": ["a", ""]},
    {"regex": "  "}, {"json_object": "yes"}, {"regex": "a", "disable_any_whitespace": 1},
])
def test_exactly_one_well_typed_constraint(kw) -> None:
    with pytest.raises(SamplingParamsError, match="structured_outputs"):
        Constraint(**kw)


def test_a_dict_schema_keeps_its_key_order() -> None:
    c = Constraint(json={"b": 1, "a": 2})
    assert c.json == '{"b": 1, "a": 2}' and c.kind == "json"


@pytest.mark.parametrize(("c", "kind"), [
    (Constraint(json={"type": "nope"}), "json"), (Constraint(json="{not json"), "json"),
    (Constraint(regex="[a-"), "regex"), (Constraint(grammar='start: "a" )'), "grammar"),
    (Constraint(grammar="root ::= [a-"), "grammar"),
])
def test_a_bad_constraint_names_its_kind(c, kind) -> None:
    with pytest.raises(InvalidGrammarError, match=f"structured_outputs.{kind}"):
        grammar_text(c)


@pytest.fixture(scope="module")
def gate(byte_tokenizer):
    g = GrammarGate(byte_tokenizer, byte_tokenizer.vocab_size,
                    [byte_tokenizer.hf.eos_token_id or 0], max_model_len=512)
    yield g
    g.shutdown()


def _held(gate: GrammarGate, spec: Constraint, n: int = 1) -> list[SimpleNamespace]:
    seqs = [SimpleNamespace(group_id="g", grammar=None, output_token_ids=[]) for _ in range(n)]
    gate.hold(seqs[0], seqs, grammar_text(spec))
    deadline = time.monotonic() + 60
    while gate.num_held and time.monotonic() < deadline:
        for _, error in gate.release(wait_s=1.0):
            assert error is None
    assert all(s.grammar is not None for s in seqs)
    return seqs


def _bits(mask: bytes, vocab: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")[:vocab].astype(bool)


def test_draft_masks_equal_step_by_step_masks_and_roll_back(gate, byte_tokenizer) -> None:
    vocab = byte_tokenizer.vocab_size
    (seq,) = _held(gate, Constraint(regex=r"[0-9]{3}-[a-z]{2}"))
    grammar = seq.grammar
    # Walk the grammar by its lowest admitted token, remembering each position's mask.
    walked, masks = [], []
    for _ in range(4):
        row = grammar.masks([])
        masks.append(row)
        token = int(np.flatnonzero(_bits(row, vocab))[0])
        assert grammar.accept(token)
        walked.append(token)
    # Back to the start, in a fresh copy: the drafts' rows are the walked masks.
    (fresh,) = _held(gate, Constraint(regex=r"[0-9]{3}-[a-z]{2}"))
    before = fresh.grammar.masks([])
    together = fresh.grammar.masks(walked[:3])
    width = len(before)
    assert together == b"".join(masks[:4])
    assert fresh.grammar.masks([]) == before  # rolled back
    # A refused draft: rows after it admit everything, and it was never consumed.
    refused = int(np.flatnonzero(~_bits(masks[1], vocab))[0])
    out = fresh.grammar.masks([walked[0], refused, walked[1]])
    assert out[: 2 * width] == b"".join(masks[:2])
    assert out[2 * width:] == b"\xff" * (2 * width)
    assert fresh.grammar.masks([]) == before
    assert not fresh.grammar.accept(refused)


def test_each_sequence_has_its_own_matcher_and_a_grammar_ends_a_choice(gate,
                                                                         byte_tokenizer) -> None:
    tok = byte_tokenizer
    a, b = _held(gate, Constraint(choice=["ab", "abc!"]), n=2)
    for t in tok.encode("abc!"):
        assert a.grammar.accept(t)
    assert a.grammar.stopped and not b.grammar.stopped
    assert all(b.grammar.accept(t) for t in tok.encode("ab"))


def test_compiled_grammars_are_cached_by_text(gate) -> None:
    text = grammar_text(Constraint(regex="x{2,5}"))
    assert gate._compiled(text) is gate._compiled(text)
    assert gate._compiled(text) is not gate._compiled(grammar_text(Constraint(regex="x{2,6}")))


# A schema whose strings, digits and arrays run on for as long as the sampler likes, with
# required properties, a pattern and nesting that a completion has to fill in.
_OPEN_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "code": {"type": "string", "pattern": "^[0-9]+-[a-z]+$"},
        "size": {"type": "integer", "minimum": 3},
        "inner": {"type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"]},
    },
    "required": ["title", "tags", "code", "size", "inner"],
    "additionalProperties": False,
}


def _random_walk(grammar, vocab: int, draw_index, steps: int) -> list[int]:
    """Take up to ``steps`` tokens the grammar allows, chosen by ``draw_index``."""
    taken = []
    for _ in range(steps):
        if grammar.stopped:
            break
        allowed = np.flatnonzero(_bits(grammar.masks([]), vocab))
        token = int(allowed[draw_index(len(allowed))])
        assert grammar.accept(token)
        taken.append(token)
    return taken


@settings(max_examples=40, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(0, 60),
       st.sampled_from(["json", "regex", "lark"]))
def test_the_closing_completes_the_grammar_from_wherever_a_sequence_stands(
        gate, byte_tokenizer, rnd, steps, kind) -> None:
    tok = byte_tokenizer
    spec = {"json": Constraint(json=_OPEN_SCHEMA),
            "regex": Constraint(regex=r"[a-z]+(-[0-9]+)*\.[a-z]{2,}"),
            "lark": Constraint(grammar='start: "(" item ("," item)* ")"\nitem: /[a-z]+[0-9]*/')}
    (seq,) = _held(gate, spec[kind])
    grammar = seq.grammar
    taken = _random_walk(grammar, tok.vocab_size, lambda n: rnd.randrange(n), steps)
    if grammar.stopped:
        return
    closing = gate._closer.closing(grammar._matcher)
    assert closing is not None
    closing = closing.tokens
    before = grammar.masks([])
    assert before == grammar.masks([])  # the walk left the matcher where it was
    for t in closing:
        assert grammar.accept(t)
    assert grammar.stopped
    eos = tok.hf.eos_token_id
    text = tok.decode([t for t in taken + closing if t != eos])
    if kind == "json":
        jsonschema.validate(json.loads(text), _OPEN_SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(r"[a-z]+(-[0-9]+)*\.[a-z]{2,}", text), text
    else:
        assert re.fullmatch(r"\([a-z]+[0-9]*(,[a-z]+[0-9]*)*\)", text), text


def test_near_the_end_of_its_budget_a_sequence_is_forced_through_its_closing(
        gate, byte_tokenizer) -> None:
    vocab = byte_tokenizer.vocab_size
    (seq,) = _held(gate, Constraint(json=_OPEN_SCHEMA))
    grammar = seq.grammar
    _random_walk(grammar, vocab, lambda n: n // 2, 12)  # into the title string, say
    closing = gate._closer.closing(grammar._matcher).tokens
    width = len(grammar.masks([]))
    # With room to spare the sequence samples freely; the closing starts once the tokens left
    # are within the slack of its length (the full slack: the first look saw a large budget).
    assert _bits(grammar.masks([], budget=1000), vocab).sum() > 1
    roomy = grammar.masks([], budget=len(closing) + CLOSING_SLACK + 1)
    assert _bits(roomy, vocab).sum() > 1 and not grammar.closed_by_budget
    row = grammar.masks([], budget=len(closing) + CLOSING_SLACK)
    assert grammar.closed_by_budget
    assert np.flatnonzero(_bits(row, vocab)).tolist() == [closing[0]]
    # Drafts on the forced path get the forced rows; the position after one off it is unused.
    rows = grammar.masks(closing[:2] + [closing[0]])
    assert [np.flatnonzero(_bits(rows[i * width:(i + 1) * width], vocab)).tolist()
            for i in range(3)] == [[closing[0]], [closing[1]], [closing[2]]]
    off = grammar.masks([closing[1]])
    assert off[width:] == b"\xff" * width
    for t in closing:
        assert np.flatnonzero(_bits(grammar.masks([], budget=1), vocab)).tolist() == [t]
        assert grammar.accept(t)
    assert grammar.stopped and grammar.closed_by_budget


def test_a_closing_the_grammar_forces_byte_for_byte_is_no_cut(gate, byte_tokenizer) -> None:
    # Only one text fits: forcing it early takes nothing from the model, so the choice
    # ends as a stop, not as a length cap.
    (seq,) = _held(gate, Constraint(regex=r"It is 12:00\."))
    closing = gate._closer.closing(seq.grammar._matcher)
    assert closing is not None and not closing.chosen
    seq.grammar.masks([], budget=1)
    assert not seq.grammar.closed_by_budget
    (free,) = _held(gate, Constraint(regex=r"It is [0-9]+\."))
    assert gate._closer.closing(free.grammar._matcher).chosen


def test_a_small_budget_keeps_a_smaller_slack(gate, byte_tokenizer) -> None:
    vocab = byte_tokenizer.vocab_size
    (seq,) = _held(gate, Constraint(json_object=True, disable_any_whitespace=True))
    grammar = seq.grammar
    (brace,) = np.flatnonzero(_bits(grammar.masks([], budget=16), vocab))  # "{" is forced
    assert grammar.accept(int(brace)) and not grammar.closed_by_budget
    closing = gate._closer.closing(grammar._matcher).tokens  # "}"
    # max_tokens 16 keeps a slack of 2: the closing is forced with 2 tokens to spare, not 16,
    # so the model has the rest to write in.
    for budget in range(15, len(closing) + 2, -1):
        assert _bits(grammar.masks([], budget=budget), vocab).sum() > 1, budget
    row = grammar.masks([], budget=len(closing) + 2)
    assert np.flatnonzero(_bits(row, vocab)).tolist() == closing[:1]


def test_the_walk_writes_a_space_last_whatever_it_wrote_before(gate) -> None:
    # Spaces the walk wrote (a forced key separator, say) must not make a space look like a
    # fresher choice than a letter it wrote more often.
    (seq,) = _held(gate, Constraint(regex=r"[ a]{6}b"))
    step = gate._closer._next_byte(seq.grammar._matcher, bytearray(b"  aaa"))
    assert step is not None and step[0] == ord("a")
