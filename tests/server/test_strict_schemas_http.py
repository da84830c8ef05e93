"""``strict`` on ``response_format.json_schema`` and on ``tools[].function``: the schema is
enforced whatever it says (vLLM's behaviour), so ``strict: false`` and ``strict: true`` both give
schema-valid output on a tiny random Llama; ``/openapi.json`` says so."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import jsonschema
import pytest

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "tag": {"enum": ["a", "b"]}},
          "required": ["n", "tag"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "A record, please."}]


@pytest.fixture(scope="module")
def env(llama_dir, srv) -> Iterator[SimpleNamespace]:
    with srv.openai(llama_dir) as e, httpx.Client(base_url=e.url, timeout=60) as http:
        e.http = http
        yield e


def _post(env: SimpleNamespace, **body: object) -> dict:
    resp = env.http.post("/v1/chat/completions", json={
        "model": env.model, "messages": CHAT, "max_tokens": 48, "temperature": 1.0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


@pytest.mark.parametrize("strict", [False, True])
def test_a_json_schema_is_enforced_strict_or_not(env, strict) -> None:
    fmt = {"type": "json_schema",
           "json_schema": {"name": "rec", "schema": SCHEMA, "strict": strict}}
    for seed in range(2):
        # Compact JSON: a random model free to write whitespace rarely stops writing it (tool
        # calls are compact already).
        choice = _post(env, response_format=fmt, seed=seed,
                       structured_outputs={"disable_any_whitespace": True})
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


@pytest.mark.parametrize("strict", [False, True])
def test_a_tools_schema_is_enforced_strict_or_not(env, strict) -> None:
    tools = [{"type": "function",
              "function": {"name": "rec", "parameters": SCHEMA, "strict": strict}}]
    choice = _post(env, tools=tools, seed=1,
                   tool_choice={"type": "function", "function": {"name": "rec"}})
    (call,) = choice["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)


def test_the_openapi_schema_says_strict_is_always_enforced(env) -> None:
    schemas = env.http.get("/openapi.json").json()["components"]["schemas"]
    described = [s["properties"]["strict"].get("description", "") for s in schemas.values()
                 if "strict" in s.get("properties", {})]
    assert len(described) >= 2 and all("true or false alike" in d for d in described)
