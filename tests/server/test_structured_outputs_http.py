"""Structured outputs through the official ``openai`` client on a tiny random Llama: OpenAI's
``response_format`` (json_schema, json_object), vLLM's ``structured_outputs`` and ``guided_*``
fields, streamed and not, each output checked with ``jsonschema`` or ``re``; a bad constraint
or two constraints at once is a 400 naming the field, and the server serves on."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from types import SimpleNamespace

import jsonschema
import pytest

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Give me a record."}]


@pytest.fixture(scope="module")
def env(llama_dir, srv) -> Iterator[SimpleNamespace]:
    with srv.openai(llama_dir) as e:
        yield e


def test_response_format_json_schema_chat(env) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA}}
    for seed in range(3):
        # Compact JSON: a random model, free to add whitespace, rarely stops adding it.
        out = env.oai.chat.completions.create(
            model=env.model, messages=CHAT, max_completion_tokens=64, temperature=1.0,
            seed=seed, response_format=fmt,
            extra_body={"structured_outputs": {"disable_any_whitespace": True}})
        choice = out.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_structured_outputs_streamed_equals_non_streamed(env) -> None:
    kw = dict(model=env.model, prompt="id:", max_tokens=32, temperature=1.0, seed=5,
              extra_body={"structured_outputs": {"regex": r"[a-f0-9]{4}-(x|yy)"}})
    whole = env.oai.completions.create(**kw).choices[0]
    chunks = list(env.oai.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert re.fullmatch(r"[a-f0-9]{4}-(x|yy)", whole.text) and text == whole.text
    assert whole.finish_reason == "stop" == chunks[-1].choices[0].finish_reason


def test_guided_choice_and_json_object(env) -> None:
    out = env.oai.completions.create(
        model=env.model, prompt="pick:", max_tokens=16, temperature=1.0, n=3, seed=1,
        extra_body={"guided_choice": ["left", "right", "up"]})
    assert all(c.text in ("left", "right", "up") for c in out.choices)
    obj = env.oai.chat.completions.create(
        model=env.model, messages=CHAT, max_completion_tokens=200, temperature=1.0, seed=3,
        response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}}, "response_format"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"guided_grammar": 'start: "a" )'}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
])
def test_a_bad_constraint_is_a_400_naming_its_field(env, extra, param) -> None:
    import openai

    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            env.oai.completions.create(model=env.model, prompt="x", max_tokens=4,
                                       stream=stream, extra_body=extra)
        assert info.value.body["param"] == param, info.value.body
    ok = env.oai.completions.create(model=env.model, prompt="x", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")
