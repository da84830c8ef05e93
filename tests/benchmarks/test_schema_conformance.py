"""A handful of the schema-conformance set (``benchmarks/scripts/data/schemas.json``) on the
real default model, SmolLM2-135M-Instruct, sampled at temperature 1 through the HTTP server,
n = 1 and n = 2, streamed and not: every choice validates (the script exits 1 otherwise).
The full set is ``benchmarks/scripts/schema_conformance.py`` with no arguments."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from helpers.real_model import convert_into, skip_reason

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scripts" / "schema_conformance.py"
# A pattern, a nested array of objects, an anyOf of objects, numbers and an enum, an array.
HANDFUL = ["book", "order", "any_of_shapes", "temperature", "tags_array"]

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


def _script():
    spec = importlib.util.spec_from_file_location("schema_conformance", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_set_is_well_formed() -> None:
    import jsonschema

    entries = json.loads((SCRIPT.parent / "data" / "schemas.json").read_text())
    assert len(entries) >= 30 and len({e["name"] for e in entries}) == len(entries)
    assert set(HANDFUL) <= {e["name"] for e in entries}
    for e in entries:
        jsonschema.Draft202012Validator.check_schema(e["schema"])


def test_a_handful_of_schemas_validate_on_smollm2(real_model_cache, capsys) -> None:
    script = _script()
    # The checker itself: a truncated or off-schema choice is invalid; one the server closed
    # when max_tokens ran short is valid, and counted apart.
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert script.check('{"a": 1}', "stop", schema) == (True, "")
    assert script.check('{"a": 1}', "length", schema) == (True, "closed by max_tokens")
    assert script.check('{"a": 1', "length", schema) == (False, "cut off by max_tokens")
    assert not script.check('{"a": "x"}', "stop", schema)[0]
    model = convert_into(real_model_cache)
    status = script.main(["--model", str(model), "--only", *HANDFUL, "--n", "1", "2",
                          "--max-tokens", "160", "--max-model-len", "512", "--seed", "3"])
    out = capsys.readouterr().out
    assert status == 0, out
    # 5 schemas x (1 + 2 choices) x (whole, streamed), all valid: every string, array and
    # number of these schemas is bounded, and so are the whitespace runs and fraction digits
    # the grammar allows (controller/json_grammar.py), so no loop outlasts max_tokens.
    assert re.search(r"\| all \| 30 \| 30 \| 100.0% \| 0 \| 0 \| 0 \|", out), out
    # A string and a pattern of digits with no bound, in a budget too short for most answers:
    # the server closes each document in its last tokens.
    status = script.main(["--model", str(model), "--only", "unbounded_string", "version",
                          "--n", "2", "--stream", "off", "--max-tokens", "20",
                          "--max-model-len", "512", "--seed", "3"])
    out = capsys.readouterr().out
    assert status == 0, out
    closed = re.search(r"\| all \| 4 \| 4 \| 100.0% \| (\d) \| 0 \| 0 \|", out)
    assert closed and int(closed[1]) > 0, out
