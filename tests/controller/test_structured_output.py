"""Structured outputs in the controller: constraints refused by name before anything is
compiled, compiled grammars cached by their text, and the masks of a step with drafts equal
to the masks the same tokens get one step at a time, the matcher left where it was."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from pagedserve.controller.errors import InvalidGrammarError
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
    g = GrammarGate(byte_tokenizer, byte_tokenizer.vocab_size, [byte_tokenizer.hf.eos_token_id
                                                                or 0])
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
