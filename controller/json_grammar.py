"""The llguidance grammar of a JSON Schema, with every run a sampled model can fall into
bounded, so that a loop the model enters ends inside the grammar instead of at
``max_tokens``.

JSON lets two kinds of literal run on forever: whitespace between tokens and the digits of a
number. A small model sampled at temperature 1 falls into both (``"\\n     \\n     \\n ..."``,
``0.053333334784663287946...``). The bounds here follow llama.cpp's JSON grammars, which cap
both; they admit what JSON formatters and doubles write:

- **Whitespace**: llama.cpp's rule, one space, or one line break and an indent of at most
  ``MAX_INDENT`` spaces or tabs: what a formatter writes, one line per value up to five levels
  of four spaces (deeper lines indent less, still valid JSON). llguidance matches
  ``whitespace_pattern`` once at each place JSON allows whitespace, so the bound is on the
  whole run. Each character of a run can cost a token (a model padding with tabs writes one
  a token), so the bound is tight: looser ones (two line breaks, a longer indent) still let
  a padding model spend its budget a run at a time.
- **Numbers**: llguidance's JSON front end has no digit bound, so the schema handed to it
  (never the one outputs are validated against) gains one, each at a cost said here:

  - a ``number`` the schema bounds on at least one side, which llguidance writes in fixed
    point (no exponent) already, gets at most ten fraction digits (``multipleOf: 1e-10``, the
    finest step llguidance takes) and an open side closed at 1e18 (llguidance's widest
    range), unless the schema's range is narrower than 1e-4, where ten digits would be coarse;
  - an ``integer`` gets the int64 range on an open side (a larger one is refused);
  - a ``number`` open on both sides keeps JSON's number grammar, exponent and all, as does
    any number of ``json_object``: the only bound llguidance can express, fixed point, would
    leave ``6.02e23`` and ``1e-12`` unwritable. Such a number can still run on.

  A schema that already says ``multipleOf``, ``enum`` or ``const`` is left as it is; so is
  any schema that the bounded form would not compile (it compiles unbounded instead).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_INDENT", "WHITESPACE", "bound_numbers", "json_schema_grammar"]

MAX_INDENT = 20
WHITESPACE = rf"\x20|\r?\n[\x20\x09]{{0,{MAX_INDENT}}}"
"""What may stand between two JSON tokens (``whitespace_flexible``'s run, bounded)."""

_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_FRACTION_STEP = 1e-10  # llguidance refuses a finer multipleOf
_NUMBER_LIMIT = 1e18  # llguidance builds no range grammar past this
_INT_LIMIT = 2**63 - 1024  # int64's largest a double holds: llguidance reads bounds as doubles
_MIN_SPAN = 1e-4

# Where a schema nests schemas (draft 2020-12 and the older spellings llguidance reads).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("additionalProperties", "items", "additionalItems")


def json_schema_grammar(schema: str, *, compact: bool) -> str:
    """The llguidance grammar for the JSON Schema text ``schema``: any bounded whitespace
    run between tokens, or only ``", "`` and ``": "`` when ``compact``; numbers bounded as
    the module says. Raises what llguidance raises for a schema it cannot read."""
    import llguidance

    options: dict[str, object] = dict(_COMPACT) if compact else {"whitespace_pattern": WHITESPACE}
    build = llguidance.LLMatcher.grammar_from_json_schema
    try:
        parsed = json.loads(schema)
        bounded = json.dumps(parsed) if bound_numbers(parsed) else None
    except (ValueError, RecursionError):
        bounded = None  # llguidance names what is wrong with the text
    if bounded is not None:
        try:
            grammar = build(bounded, defaults=options)
        except Exception:  # the unbounded schema below reports what is wrong
            grammar = None
        if grammar is not None and not llguidance.LLMatcher.validate_grammar(grammar):
            return grammar
    return build(schema, defaults=options)


def bound_numbers(schema: Any) -> int:
    """Put the digit bounds of the module's docstring on every ``number`` and ``integer``
    in ``schema`` (parsed JSON, changed in place); how many it bounded."""
    if not isinstance(schema, dict):
        return 0
    count = 0
    for key in _SCHEMA_MAPS:
        if isinstance(sub := schema.get(key), dict):
            count += sum(map(bound_numbers, sub.values()))
    for key in (*_SCHEMA_LISTS, *_SCHEMA_ONE):
        sub = schema.get(key)
        count += sum(map(bound_numbers, sub if isinstance(sub, list) else [sub]))
    return count + _bound(schema)


def _bound(schema: dict[str, Any]) -> bool:
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if (not isinstance(types, list) or not {"number", "integer"} & set(types)
            or {"multipleOf", "enum", "const"} & schema.keys()):
        return False
    low, high = _side(schema, "minimum"), _side(schema, "maximum")
    if low is False or high is False:
        return False  # a bound llguidance will refuse by name
    if "number" not in types:
        if low is None:
            schema["minimum"] = -_INT_LIMIT
        if high is None:
            schema["maximum"] = _INT_LIMIT
        return low is None or high is None
    if (low is None and high is None) or (
            low is not None and high is not None and high - low < _MIN_SPAN):
        return False
    if low is None and high > -_NUMBER_LIMIT:
        schema["exclusiveMinimum"] = -_NUMBER_LIMIT
    if high is None and low < _NUMBER_LIMIT:
        schema["exclusiveMaximum"] = _NUMBER_LIMIT
    schema["multipleOf"] = _FRACTION_STEP
    return True


def _side(schema: dict[str, Any], name: str) -> float | bool | None:
    """The schema's bound on one side (``minimum`` or ``maximum``, inclusive or exclusive):
    the tighter one, None when it has none, False when one is not a number."""
    exclusive = "exclusive" + name[0].upper() + name[1:]
    values = [schema[k] for k in (name, exclusive) if k in schema]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return False
    if not values:
        return None
    return max(values) if name == "minimum" else min(values)
