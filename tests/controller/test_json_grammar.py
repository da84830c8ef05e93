"""JSON Schema grammars with bounded runs: whatever a JSON formatter writes stays valid, a
whitespace run or a number's digits cannot go on forever, and the bounds change no schema
that says more than they would (``controller/json_grammar.py``)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from pagedserve.controller.errors import InvalidGrammarError
from pagedserve.controller.json_grammar import MAX_INDENT, bound_numbers
from pagedserve.controller.structured_output import grammar_text
from pagedserve.messages import StructuredOutputsParams as Constraint

NESTED: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "number"},
                                                           "b": {"$ref": "#"}}}
DEEP = {"a": 1.5, "b": {"b": {"b": {"b": {"a": -2}}}}}  # 5 levels: an indent of 20


@pytest.fixture(scope="module")
def ll_tokenizer(byte_tokenizer):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(byte_tokenizer.hf)


@pytest.fixture(scope="module")
def accepts(ll_tokenizer, byte_tokenizer):
    import llguidance

    def accepts(schema: dict[str, Any], text: str, **kw: Any) -> bool:
        grammar = grammar_text(Constraint(json=schema, **kw))
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        return bool(matcher.consume_tokens(byte_tokenizer.encode(text))
                    and matcher.is_accepting())
    return accepts


@pytest.mark.parametrize("indent", [None, 2, 4, "\t"])
def test_what_json_formatters_write_stays_valid(accepts, indent) -> None:
    assert accepts(NESTED, json.dumps(DEEP, indent=indent))


@pytest.mark.parametrize("text", [
    '{"a":1,"b":{}}', '{ "a" : 1 , "b" : { } }', '{\r\n  "a": 1,\r\n  "b": {}\r\n}',
    '{"a":\n' + "\t" * MAX_INDENT + "1}",
])
def test_compact_spaced_and_crlf_are_valid(accepts, text) -> None:
    assert accepts(NESTED, text)


@pytest.mark.parametrize("text", [
    '{"a":  1}',  # a run of spaces
    '{"a":\n' + "\t" * (MAX_INDENT + 1) + "1}",  # a padding model's tabs
    '{\n   \n   "a": 1}',  # the line-break loop
    '{"a": 1\n\n}', '{"a": 1 \n}',
])
def test_a_whitespace_run_cannot_go_on(accepts, text) -> None:
    assert not accepts(NESTED, text)


def test_compact_json_admits_only_its_separators(accepts) -> None:
    assert accepts(NESTED, '{"a": 1, "b": {}}', disable_any_whitespace=True)
    assert not accepts(NESTED, '{"a":  1, "b": {}}', disable_any_whitespace=True)


BOUNDED = {"type": "number", "minimum": -90, "maximum": 90}


@pytest.mark.parametrize(("schema", "text", "ok"), [
    # A number with a bound: ten fraction digits, not eleven.
    (BOUNDED, "57.3398447436", True), (BOUNDED, "57.33984474364", False),
    (BOUNDED, "-90", True), (BOUNDED, "0.5", True), (BOUNDED, "90.0000000001", False),
    # An open side closed where llguidance's ranges end.
    ({"type": "number", "minimum": 0}, "999999999999999999.25", True),
    ({"type": "number", "minimum": 0}, "1000000000000000000", False),
    # Open on both sides: JSON's grammar, exponent and digits unbounded.
    ({"type": "number"}, "6.02e23", True), ({"type": "number"}, "1e-12", True),
    ({"type": "number"}, "0." + "3" * 40, True),
    # An integer: the int64 range where the schema leaves it open.
    ({"type": "integer"}, "-9223372036854774784", True),
    ({"type": "integer"}, "99999999999999999999", False),
    ({"type": "integer", "maximum": 5}, "-9223372036854774784", True),
    # What the schema says already is left as it is.
    ({"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.125}, "0.125", True),
    ({"type": "number", "minimum": 0, "maximum": 1e-5}, "0.000000000001234", True),
])
def test_number_digits(accepts, schema, text, ok) -> None:
    assert accepts(schema, text) is ok
    if ok:
        jsonschema.validate(json.loads(text), schema)


def test_numbers_are_bounded_wherever_the_schema_nests_them() -> None:
    schema = {
        "type": "object",
        "properties": {"p": BOUNDED, "q": {"anyOf": [{"type": ["integer", "null"]},
                                                     {"type": "string"}]}},
        "additionalProperties": {"type": "number", "maximum": 3},
        "$defs": {"d": {"type": "array", "items": {"type": "integer", "minimum": 0},
                        "prefixItems": [{"type": "number", "exclusiveMinimum": 0}]}},
    }
    assert bound_numbers(schema) == 5
    assert schema["properties"]["p"]["multipleOf"] == 1e-10
    assert schema["properties"]["q"]["anyOf"][0]["maximum"] == 2**63 - 1024
    assert schema["additionalProperties"]["exclusiveMinimum"] == -1e18
    assert schema["$defs"]["d"]["items"]["maximum"] == 2**63 - 1024
    assert schema["$defs"]["d"]["prefixItems"][0]["exclusiveMaximum"] == 1e18
    untouched = [{"type": "number"}, {"enum": [1, 2]}, {"type": "integer", "const": 3},
                 {"type": "number", "minimum": True}, {"type": "integer", "minimum": 0,
                                                       "maximum": 9}]
    assert [bound_numbers(s) for s in untouched] == [0] * len(untouched)


def test_a_schema_llguidance_refuses_is_refused_in_its_own_words() -> None:
    # Bounded, this schema would be an empty range; the error names the schema's own bound.
    with pytest.raises(InvalidGrammarError, match="integer range") as info:
        grammar_text(Constraint(json={"type": "integer", "minimum": 1e19}))
    assert "greater than" not in str(info.value)
