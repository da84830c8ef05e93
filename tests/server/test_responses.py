"""``POST /v1/responses`` through the official ``openai`` client, on the tiny random Llama
given a chat template that renders tools and writes calls as Hermes does.

A Responses call is the chat completion it amounts to, so greedy text and usage must equal the
chat endpoint's for the same conversation; streamed, the events come in the order the SDK
expects and their deltas add up to the final text. A json_schema ``text.format`` and a named
``tool_choice`` constrain even a random model, so their outputs are checked with
``jsonschema``; a tool call goes out as a ``function_call`` item and comes back, with its
output, into the prompt the template renders. With ``include`` the output_text carries the
chat answer's token logprobs, whole and streamed. The server is the session's
``hermes_server``, shared with ``test_tool_calls``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.responses import Response

TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_time", "description": "The time.",
          "parameters": TIME, "strict": True}]
RECORD = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
TEXT_END = ["response.output_text.done", "response.content_part.done",
            "response.output_item.done"]


@pytest.fixture
def env(hermes_server: SimpleNamespace) -> SimpleNamespace:
    return hermes_server


def _events(env: SimpleNamespace, **kw: Any) -> list[Any]:
    events = list(env.oai.responses.create(model=env.model, stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_text_whole_and_streamed_is_the_chat_answer(env) -> None:
    kw = {"instructions": "Be brief.", "max_output_tokens": 12, "temperature": 0.0}
    chat = env.oai.chat.completions.create(
        model=env.model, max_completion_tokens=12, temperature=0.0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hello"}])
    resp = env.oai.responses.create(model=env.model, input="Hello", metadata={"k": "v"}, **kw)
    Response.model_validate(resp.model_dump())  # strictly the SDK's type, not just parsed
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.model == env.model and resp.metadata == {"k": "v"}
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant"
    assert item.content[0].type == "output_text"
    assert resp.output_text == item.content[0].text == chat.choices[0].message.content
    assert resp.output_text  # the random model writes something in 12 tokens
    length = chat.choices[0].finish_reason == "length"
    assert resp.status == ("incomplete" if length else "completed")
    assert (resp.incomplete_details.reason if length else resp.incomplete_details) == (
        "max_output_tokens" if length else None)
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)

    # The same turn as items, streamed.
    events = _events(env, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Hel"}, {"type": "input_text", "text": "lo"}]}], **kw)
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    end = "response.incomplete" if length else "response.completed"
    assert types == TEXT_EVENTS + ["response.output_text.delta"] * len(deltas) + TEXT_END + [end]
    assert "".join(deltas) == resp.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == resp.output_text and final.status == resp.status
    assert final.usage.output_tokens == resp.usage.output_tokens
    ids = {e.item.id if e.type.startswith("response.output_item") else e.item_id
           for e in events[2:-1]}
    assert ids == {final.output[0].id}


def test_json_schema_format_validates(env) -> None:
    fmt = {"format": {"type": "json_schema", "name": "record", "schema": RECORD,
                      "strict": True}}
    for _ in range(2):
        resp = env.oai.responses.create(model=env.model, input="A record.", text=fmt,
                                        temperature=1.0, max_output_tokens=64)
        assert resp.status == "completed"
        jsonschema.validate(json.loads(resp.output_text), RECORD)
        assert resp.text.format.type == "json_schema"
    events = _events(env, input="A record.", text=fmt, temperature=1.0, max_output_tokens=64)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    jsonschema.validate(json.loads(text), RECORD)
    assert events[-1].type == "response.completed" and events[-1].response.output_text == text


def test_a_tool_call_round_trip(env) -> None:
    first = env.oai.responses.create(model=env.model, input="What time is it?", tools=TOOLS,
                                     tool_choice={"type": "function", "name": "get_time"},
                                     temperature=1.0)
    assert first.status == "completed"
    Response.model_validate(first.model_dump())
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_time"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    zone = json.loads(call.arguments)["zone"]
    jsonschema.validate(json.loads(call.arguments), TIME)

    # Streamed, the SDK's own accumulator rebuilds the call from the events.
    with env.oai.responses.stream(model=env.model, input="What time is it?", tools=TOOLS,
                                  tool_choice={"type": "function", "name": "get_time"}) as s:
        types = [e.type for e in s]
        streamed = s.get_final_response()
    (scall,) = streamed.output
    jsonschema.validate(json.loads(scall.arguments), TIME)
    assert types[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert set(types[3:-3]) == {"response.function_call_arguments.delta"}

    # The call and its output go back in; the answer is text (JSON, to pin the random model).
    said = {"type": "object", "properties": {"time": {"const": "12:00"}}, "required": ["time"],
            "additionalProperties": False}
    answer = json.dumps({"zone": zone, "time": "12:00"})
    history = [{"role": "user", "content": "What time is it?"},
               *(item.model_dump(exclude_unset=True) for item in first.output),
               {"type": "function_call_output", "call_id": call.call_id, "output": answer}]
    second = env.oai.responses.create(
        model=env.model, input=history, tools=TOOLS, tool_choice="none", max_output_tokens=32,
        text={"format": {"type": "json_schema", "name": "said", "schema": said}})
    (message,) = second.output
    assert message.type == "message" and json.loads(second.output_text) == {"time": "12:00"}
    # The prompt was the chat template's rendering of that history.
    chat = [{"role": "user", "content": "What time is it?"},
            {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
             "function": {"name": "get_time", "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "name": "get_time",
             "content": answer}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                  for t in TOOLS]
    ids = env.http.post("/tokenize", json={"messages": chat, "tools": chat_tools}).json()
    assert second.usage.input_tokens == len(ids["tokens"])
    text = env.client.tokenizer.decode(ids["tokens"], skip_special_tokens=False)
    assert f'<tool_call>{{"name": "get_time", "arguments": {{"zone": "{zone}"}}}}' in text
    assert f"<|tool|>\n[{call.call_id}] {answer}" in text


def _entries(logprobs: Any) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs or ()])
            for e in logprobs]


def _same(a: Any, b: Any) -> None:
    """Equal entries; logprobs to 1e-3, as a prefix-cache hit computes the prompt apart."""
    assert [(t, [x for x, _ in top]) for t, _, top in a] == [
        (t, [x for x, _ in top]) for t, _, top in b]
    flat = [[lp, *(v for _, v in top)] for _, lp, top in a]
    assert flat == [pytest.approx([lp, *(v for _, v in top)], abs=1e-3) for _, lp, top in b]


def test_output_text_logprobs_whole_and_streamed_are_the_chat_answer_s(env) -> None:
    kw = {"input": "Hello", "max_output_tokens": 8, "temperature": 0.0}
    asked = {**kw, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    chat = env.oai.chat.completions.create(
        model=env.model, max_completion_tokens=8, temperature=0.0, logprobs=True,
        top_logprobs=2, messages=[{"role": "user", "content": "Hello"}])
    resp = env.oai.responses.create(model=env.model, **asked)
    Response.model_validate(resp.model_dump())
    assert resp.top_logprobs == 2
    part = resp.output[0].content[0]
    assert part.text == chat.choices[0].message.content
    expected = chat.choices[0].logprobs.content
    _same(_entries(part.logprobs), _entries(expected))
    assert [e.bytes for e in part.logprobs] == [e.bytes for e in expected]
    assert len(part.logprobs) == resp.usage.output_tokens
    assert all(len(e.top_logprobs) == 2 for e in part.logprobs)
    # As at OpenAI: no include, no logprobs, top_logprobs or not.
    for extra in ({}, {"top_logprobs": 2}):
        plain = env.oai.responses.create(model=env.model, **kw, **extra)
        assert plain.output[0].content[0].logprobs == []

    events = _events(env, **asked)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [entry for e in deltas for entry in _entries(e.logprobs)]
    _same(streamed, _entries(part.logprobs))
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert _entries(done.logprobs) == streamed
    final = events[-1].response.output[0].content[0]
    assert _entries(final.logprobs) == streamed and final.text == part.text
    assert all(e.logprobs == [] for e in _events(env, **kw)
               if e.type == "response.output_text.delta")


def test_logprobs_go_with_the_text_they_wrote() -> None:
    """Reasoning before the text and a call after it: the text's part gets the entries of
    its own tokens, whole and streamed, and the stream's events stay the SDK's types."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from pagedserve.serving.openai.responses_output import ResponseEvents, TextLogprobs
    from pagedserve.serving.openai.tools import ChatText
    from pagedserve.serving.reasoning_parsers import REASONING_PARSERS
    from pagedserve.serving.tool_parsers import TOOL_CALL_PARSERS

    tokens = ["<think>", "It is", "</think>", "It", " is", " <tool_call>", '{"name": ',
              '"get_time", "arguments": {"zone": "UTC"}}', "</tool_call>"]
    entries = [{"token": t, "logprob": -float(i), "bytes": list(t.encode()),
                "top_logprobs": []} for i, t in enumerate(tokens)]
    fmt, reasoning = TOOL_CALL_PARSERS["hermes"], REASONING_PARSERS["qwen3"]
    whole, _ = ChatText(fmt, reasoning).message("".join(tokens), "stop")
    (_, message, _) = _shape().output(whole, "completed", entries)
    assert message["content"][0]["text"] == "It is"
    assert [e["token"] for e in message["content"][0]["logprobs"]] == ["It", " is"]

    events, chat, aligned = ResponseEvents(_shape()), ChatText(fmt, reasoning), TextLogprobs()
    sse = events.start()
    for i, entry in enumerate(entries):
        aligned.add([entry])
        out, _ = chat.delta(entry["token"], "stop" if i == len(entries) - 1 else None)
        aligned.take(out.get("reasoning_content", ""))
        sse += events.delta(out, aligned.take(out.get("content", "")))
    sse += events.finish({"input_tokens": 1, "input_tokens_details": {
        "cached_tokens": 0, "cache_write_tokens": 0}, "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 10}, False)
    adapter = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_json(s.split("\n")[1].removeprefix("data: ")) for s in sse]
    streamed = [lp.token for e in parsed if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    assert streamed == ["It", " is"]
    final = Response.model_validate(parsed[-1].response.model_dump())
    assert [lp.token for lp in final.output[1].content[0].logprobs] == ["It", " is"]


@pytest.mark.parametrize(("kw", "param"), [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"extra_body": {"frequency_penalty": 1.0}}, "frequency_penalty"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format"),
])
def test_refused_fields_are_named(env, kw: dict[str, Any], param: str) -> None:
    kw = {"input": "Hi", "max_output_tokens": 4, **kw}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            env.oai.responses.create(model=env.model, stream=stream, **kw)
        body = info.value.body
        assert body["param"] == param, body
        assert param.split(".")[0] in body["message"], body


def _shape() -> Any:
    from pagedserve.serving.openai.responses_output import ResponseShape
    from pagedserve.serving.openai.responses_protocol import ResponsesRequest

    body = ResponsesRequest.model_validate({"input": "Where?", "tools": TOOLS})
    return ResponseShape("resp_1", 0, "m", body)


def test_every_event_and_item_is_the_sdk_s_type() -> None:
    """Reasoning, text and a call, in small pieces: each event validates strictly as the SDK's
    event type, and the final response as its ``Response``, with the items the whole answer
    (``ResponseShape.output``) has."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from pagedserve.serving.openai.api_errors import APIError
    from pagedserve.serving.openai.responses_output import ResponseEvents
    from pagedserve.serving.openai.tools import ChatText
    from pagedserve.serving.reasoning_parsers import REASONING_PARSERS
    from pagedserve.serving.tool_parsers import TOOL_CALL_PARSERS

    text = ('<think>Paris.</think>It is <tool_call>{"name": "get_time", "arguments": '
            '{"zone": "UTC"}}</tool_call>')
    fmt, reasoning = TOOL_CALL_PARSERS["hermes"], REASONING_PARSERS["qwen3"]
    shape, adapter = _shape(), TypeAdapter(ResponseStreamEvent)
    events = ResponseEvents(shape)
    chat = ChatText(fmt, reasoning)
    sse = events.start()
    for i in range(0, len(text), 3):
        out, reason = chat.delta(text[i:i + 3], "stop" if i + 3 >= len(text) else None)
        sse += events.delta(out)
    assert reason == "tool_calls"
    sse += events.finish({"input_tokens": 3, "input_tokens_details": {"cached_tokens": 0,
                                                                  "cache_write_tokens": 0},
                          "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": 12}, incomplete=False)
    parsed = []
    for s in sse:
        head, data = s.removesuffix("\n\n").split("\n")
        parsed.append(adapter.validate_json(data.removeprefix("data: ")))
        assert head == f"event: {parsed[-1].type}"
    final = Response.model_validate(parsed[-1].response.model_dump())
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "Paris."
    assert final.output_text == "It is"
    assert (final.output[2].name, final.output[2].arguments) == ("get_time", '{"zone": "UTC"}')
    whole, _ = ChatText(fmt, reasoning).message(text, "stop")
    items = shape.output(whole, "completed")
    assert [(i["type"], i.get("arguments")) for i in items] == [
        (i.type, getattr(i, "arguments", None)) for i in final.output]
    failed = [adapter.validate_json(s.split("\n")[1].removeprefix("data: "))
              for s in ResponseEvents(shape).fail(APIError(503, "gone", code="down"))]
    assert [(e.type, e.sequence_number) for e in failed] == [("error", 0),
                                                              ("response.failed", 1)]
    assert failed[1].response.error.message == "gone"


OK, REFUSED = True, False
# Every declared field: a value that uses it, and whether it is honoured (200) or refused by
# name (400); the value of a refused field is one it would act on.
FIELDS: dict[str, tuple[Any, bool]] = {
    "instructions": ("Be brief.", OK), "tools": (TOOLS, OK), "tool_choice": ("none", OK),
    "parallel_tool_calls": (False, OK), "text": ({"format": {"type": "json_object"}}, OK),
    "max_output_tokens": (2, OK), "temperature": (0.5, OK), "top_p": (0.9, OK),
    "stream": (False, OK), "metadata": ({"k": "v"}, OK), "user": ("u", OK),
    "safety_identifier": ("s", OK), "prompt_cache_key": ("k", OK), "store": (True, REFUSED),
    "previous_response_id": ("resp_1", REFUSED), "conversation": ("conv_1", REFUSED),
    "background": (True, REFUSED), "include": (["message.output_text.logprobs"], OK),
    "reasoning": ({"effort": "low"}, REFUSED), "truncation": ("auto", REFUSED),
    "top_logprobs": (2, OK), "max_tool_calls": (1, REFUSED),
    "prompt": ({"id": "pmpt_1"}, REFUSED), "service_tier": ("flex", REFUSED),
}


def test_every_field_is_honoured_or_refused_by_name(env) -> None:
    from pagedserve.serving.openai.responses_protocol import ResponsesRequest

    assert set(ResponsesRequest.model_fields) == set(FIELDS) | {"model", "input"}
    for name, (value, honoured) in FIELDS.items():
        resp = env.http.post("/v1/responses", json={
            "input": "Hi", "max_output_tokens": 2, "tools": TOOLS, name: value})
        if honoured:
            assert resp.status_code == 200, (name, resp.text)
            continue
        assert resp.status_code == 400, (name, resp.text)
        err = resp.json()["error"]
        assert err["param"] == name and "not supported" in err["message"], (name, err)
    # Declared, so /openapi.json shows the route's body and each refused field's rule.
    schemas = env.http.get("/openapi.json").json()
    body = schemas["paths"]["/v1/responses"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"]["$ref"].endswith("/ResponsesRequest")
    assert "only False" in schemas["components"]["schemas"]["ResponsesRequest"][
        "properties"]["store"]["description"]
