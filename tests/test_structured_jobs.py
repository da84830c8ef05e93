"""Structured outputs in the JSONL generate job, on a tiny random Llama: a line's
``response_format``, ``structured_outputs`` or ``guided_json`` (in the job's own line format and
in the Batch API's) constrains its output, which ``jsonschema`` then validates; a line with a
bad constraint fails alone, with an error naming what is wrong, and the other lines complete."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from helpers.checkpoints import make_checkpoint

from pagedserve.builder import start_engine
from pagedserve.config import from_flat
from pagedserve.serving.jsonl_job.job import run_job

SCHEMA = {"type": "object",
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"enum": ["red", "green"]}},
          "required": ["n", "tag"], "additionalProperties": False}
# guided_json cannot be made compact (structured_outputs beside it is a second constraint), so
# its schema leaves no room for whitespace inside the value.
ENUM = {"enum": ["red", "green"]}
# A random model, free to add whitespace, rarely stops adding it: compact JSON ends in time.
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
SAMPLED = {"max_tokens": 48, "temperature": 1.0}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    ckpt = make_checkpoint("llama", tmp_path_factory.mktemp("so-job") / "llama")
    c = start_engine(from_flat(model=str(ckpt), max_model_len=128, num_gpu_blocks=64,
                               block_size=16), backend="local")
    yield c
    c.shutdown()


def _run(client, tmp_path: Path, lines: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = run_job(client, str(inp), str(out), SAMPLED, progress="none")
    recs = [json.loads(t) for t in out.read_text().splitlines()]
    assert summary.total == len(lines) == len(recs)
    return {r["id"]: r for r in recs}


def test_constrained_lines_validate_and_a_bad_one_fails_alone(client, tmp_path: Path) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA}}
    bad = {"type": "object", "properties": {"n": {"type": "integr"}}}
    lines = [
        {"id": "fmt", "prompt": "A record:", "seed": 1, "response_format": fmt, **COMPACT},
        {"id": "so", "prompt": "Another:", "seed": 2, "n": 2,
         "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        {"id": "guided", "prompt_token_ids": [5, 6, 7], "seed": 3, "guided_json": ENUM},
        {"custom_id": "batch", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "seed": 4,
                  "response_format": fmt, **COMPACT}},
        {"id": "bad-schema", "prompt": "x", "guided_json": bad},
        {"id": "two", "prompt": "x", "guided_json": SCHEMA, "response_format": fmt},
        {"id": "bad-type", "prompt": "x", "response_format": {"type": "xml"}},
        {"id": "plain", "prompt": "No constraint here", "max_tokens": 4},
    ]
    recs = _run(client, tmp_path, lines)
    for rid in ("fmt", "so", "guided", "batch"):
        rec, schema = recs[rid], ENUM if rid == "guided" else SCHEMA
        assert "error" not in rec, rec
        texts = [c["text"] for c in rec.get("choices", [rec])]
        assert len(texts) == (2 if rid == "so" else 1)
        for text in texts:
            jsonschema.validate(json.loads(text), schema)
        assert rec["finish_reason"] == "stop"
    assert recs["batch"]["custom_id"] == "batch"
    assert "error" not in recs["plain"] and recs["plain"]["usage"]["completion_tokens"] == 4
    assert recs["bad-schema"]["error_type"] == "InvalidGrammarError"
    assert "integr" in recs["bad-schema"]["error"]
    assert "only one structured-output field" in recs["two"]["error"]
    assert "guided_json" in recs["two"]["error"] and "response_format" in recs["two"]["error"]
    assert recs["bad-type"]["error"].startswith("invalid response_format.type")
