"""Tool calling: the parsers against whole and streamed text, and ``tools`` / ``tool_choice``
end to end through the ``openai`` client, on the tiny Llama given a chat template that renders
tools and writes calls as Hermes does.

Under ``tool_choice`` required or a named function the constraint shapes the output, so even a
random model's calls name a given function and their arguments validate against its schema
(checked with ``jsonschema``). ``auto`` reads what the model wrote: a regex constraint makes the
random model write a Hermes call, and the parser must find it, streamed and not.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema
import pytest

from pagedserve.serving.openai.tools import ChatText
from pagedserve.serving.tool_parsers import TOOL_CALL_PARSERS, named_call, required_calls

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


# --------------------------------------------------------------------------- parsers
SAMPLES = [
    (TOOL_CALL_PARSERS["hermes"],
     'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 2}}\n</tool_call>\n<tool_call>{"arguments": {"zone": "a}\\"b"}, "name": '
     '"get_time"}</tool_call>',
     "Let me look.", [("get_weather", '{"city": "Paris", "days": 2}'),
                      ("get_time", '{"zone": "a}\\"b"}')]),
    (TOOL_CALL_PARSERS["hermes"], "No tools needed, <tool but plain.", "No tools needed, "
     "<tool but plain.", []),
    (TOOL_CALL_PARSERS["llama3_json"],
     '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
     '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 7}}',
     None, [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Oslo", "days": 7}')]),
    (TOOL_CALL_PARSERS["llama3_json"], "{curly} but prose", "{curly} but prose", []),
    (TOOL_CALL_PARSERS["mistral"],
     '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "CET"}}, '
     '{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}]',
     None, [("get_time", '{"zone": "CET"}'), ("get_weather", '{"city": "Rome"}')]),
    (required_calls, '[{"name": "get_time", "parameters": {"zone": "UTC"}}]', None,
     [("get_time", '{"zone": "UTC"}')]),
    (named_call("get_time"), '{"zone": "UTC"}', None, [("get_time", '{"zone": "UTC"}')]),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), SAMPLES,
                         ids=[f"{s[0].name}-{i}" for i, s in enumerate(SAMPLES)])
def test_a_stream_of_any_pieces_adds_up_to_the_whole_answer(fmt, text, content, calls) -> None:
    message, reason = ChatText(fmt).message(text, "stop")
    assert message["content"] == content
    got = [(c["function"]["name"], c["function"]["arguments"])
           for c in message.get("tool_calls", [])]
    assert got == calls
    assert reason == ("tool_calls" if calls and fmt.function is None else "stop")
    for size in (1, 2, 3, 5, 11, len(text)):
        chat = ChatText(fmt)
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        streamed, names, args, reasons = "", [], [], []
        for k, piece in enumerate(pieces):
            delta, r = chat.delta(piece, "stop" if k == len(pieces) - 1 else None)
            reasons.append(r)
            streamed += delta.get("content", "")
            for c in delta.get("tool_calls", []):
                if "id" in c:  # a call opens with its id, type and name, before any argument
                    assert c["index"] == len(names) and c["type"] == "function"
                    assert c["id"].startswith("call_")
                    names.append(c["function"]["name"])
                    args.append("")
                args[c["index"]] += c["function"]["arguments"]
        assert streamed == (content or ""), size
        assert list(zip(names, args, strict=True)) == calls, size
        assert reasons[-1] == reason and not any(reasons[:-1])


def test_a_partial_start_marker_is_held_back_until_it_is_clear() -> None:
    chat = ChatText(TOOL_CALL_PARSERS["hermes"])
    assert chat.delta("Hi <tool_", None)[0] == {"content": "Hi"}
    assert chat.delta("box>", None)[0] == {"content": " <tool_box>"}


# ------------------------------------------------------------------------------ HTTP
@pytest.fixture
def env(hermes_server: SimpleNamespace) -> SimpleNamespace:
    return hermes_server


def _chat(env: SimpleNamespace, **kw: Any) -> Any:
    return env.oai.chat.completions.create(model=env.model, messages=kw.pop("messages", ASK),
                                           max_tokens=kw.pop("max_tokens", 48), **kw)


def _streamed(env: SimpleNamespace, **kw: Any) -> tuple[str, list[tuple[str, str]], str]:
    content, calls, reason = "", [], None
    for chunk in _chat(env, stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for c in choice.delta.tool_calls or []:
                if c.id is not None:
                    assert c.index == len(calls) and c.function.name
                    calls.append([c.function.name, ""])
                calls[c.index][1] += c.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, [tuple(c) for c in calls], reason


def _valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_the_tools_and_a_call_history_reach_the_template(env) -> None:
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    ids = env.http.post("/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
    text = env.client.tokenizer.decode(ids, skip_special_tokens=False)
    assert "get_weather(city, days): The forecast." in text and "get_time(zone)" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|tool|>\n[call_1] 18C" in text
    out = _chat(env, messages=history, tools=TOOLS, tool_choice="none",
                extra_body={"return_token_ids": True})
    assert out.model_extra["prompt_token_ids"] == ids
    assert out.choices[0].message.tool_calls is None


def test_a_named_function_always_gets_arguments_that_follow_its_schema(env) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        out = _chat(env, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed)
        msg = out.choices[0].message
        assert out.choices[0].finish_reason == "stop"
        (call,) = msg.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        _valid("get_weather", call.function.arguments)
        content, calls, reason = _streamed(env, tools=TOOLS, tool_choice=choice,
                                           temperature=1.0, seed=seed)
        assert (content, reason) == ("", "stop")
        assert calls == [("get_weather", call.function.arguments)]


def test_required_calls_name_given_tools_and_follow_their_schemas(env) -> None:
    for seed in range(3):
        out = _chat(env, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                    max_tokens=300)
        assert out.choices[0].finish_reason == "tool_calls"
        calls = [(c.function.name, c.function.arguments)
                 for c in out.choices[0].message.tool_calls]
        assert calls
        for name, arguments in calls:
            _valid(name, arguments)
        assert _streamed(env, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                         max_tokens=300) == ("", calls, "tool_calls")
    single = _chat(env, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                   max_tokens=300)
    assert len(single.choices[0].message.tool_calls) == 1


def test_auto_reads_the_calls_the_model_writes(env) -> None:
    # The regex makes the random model write content and then a Hermes call.
    regex = (r'Let me check\.\n<tool_call>\{"name": "get_weather", "arguments": '
             r'\{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>')
    kw = {"tools": TOOLS, "extra_body": {"structured_outputs": {"regex": regex}},
          "max_tokens": 160, "temperature": 0.0}  # greedy: the stream must write the same
    out = _chat(env, **kw)
    msg = out.choices[0].message
    assert msg.content == "Let me check."
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather"
    _valid("get_weather", call.function.arguments)
    assert out.choices[0].finish_reason == "tool_calls"
    assert _streamed(env, **kw) == ("Let me check.", [("get_weather", call.function.arguments)],
                                    "tool_calls")
    plain = _chat(env, tools=TOOLS, extra_body={"structured_outputs": {"regex": r"No tools\."}})
    assert plain.choices[0].message.content == "No tools."
    assert plain.choices[0].message.tool_calls is None


def test_a_tool_call_round_trip_through_the_openai_client(env) -> None:
    first = _chat(env, tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = first.choices[0].message.tool_calls[0]
    answer = {"zone": json.loads(call.function.arguments)["zone"], "time": "12:00"}
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps(answer)}]
    for stream in (False, True):
        kw = {"messages": messages, "tools": TOOLS, "max_tokens": 16,
              "extra_body": {"structured_outputs": {"regex": r"It is 12:00\."}}}
        if stream:
            content, calls, reason = _streamed(env, **kw)
        else:
            out = _chat(env, **kw)
            content, calls = out.choices[0].message.content, []
            reason = out.choices[0].finish_reason
        assert (content, calls, reason) == ("It is 12:00.", [], "stop")


def _error(env: SimpleNamespace, body: dict[str, Any]) -> dict[str, Any]:
    resp = env.http.post("/v1/chat/completions",
                         json={"messages": ASK, "max_tokens": 4, **body})
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


def test_bad_tool_requests_are_refused_by_name(env, llama_dir: Path, srv: Any) -> None:
    named = {"type": "function", "function": {"name": "nope"}}
    assert _error(env, {"tools": TOOLS, "tool_choice": named})["param"] == "tool_choice"
    assert _error(env, {"tool_choice": "required"})["param"] == "tool_choice"
    assert _error(env, {"tools": TOOLS * 2})["param"] == "tools"
    both = _error(env, {"tools": TOOLS, "tool_choice": "required",
                        "response_format": {"type": "json_object"}})
    assert both["param"] == "response_format"
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]
    assert _error(env, {"tools": bad, "tool_choice": "required"})["param"] == "tools"
    history = [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    assert _error(env, {"messages": history})["param"] == "messages"
    # A template without a call syntax gives auto nothing to read calls with.
    with srv.openai(llama_dir) as plain, httpx.Client(base_url=plain.url, timeout=60) as http:
        plain.http = http
        err = _error(plain, {"tools": TOOLS})
        assert err["param"] == "tool_choice" and "--tool-call-parser" in err["message"]


AGENT = '''
import asyncio, json, sys
from typing import Literal
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                    Runner, function_tool, set_tracing_disabled)
from openai import AsyncOpenAI

set_tracing_disabled(True)
calls = []

@function_tool
def get_time(zone: Literal["UTC", "CET"]) -> str:
    """The time in a zone."""
    calls.append(zone)
    return f"12:00 {zone}"

# The SDK's two model shapes: chat completions, and the Responses API it defaults to.
api = OpenAIResponsesModel if sys.argv[3] == "responses" else OpenAIChatCompletionsModel
model = api(model=sys.argv[2], openai_client=AsyncOpenAI(
    base_url=sys.argv[1], api_key="unused", max_retries=0))
agent = Agent(name="clock", instructions="Tell the time.", tools=[get_time], model=model,
              model_settings=ModelSettings(tool_choice="required", max_tokens=64,
                                           parallel_tool_calls=False),
              tool_use_behavior="stop_on_first_tool")
result = asyncio.run(Runner.run(agent, "What time is it?"))
print(json.dumps({"calls": calls, "final": result.final_output}))
'''


def test_an_agent_framework_runs_a_tool_using_agent(env, tmp_path: Path) -> None:
    """The OpenAI Agents SDK, from PyPI in a virtual environment of its own (never one of
    ours), runs an agent whose model must call a tool; the tool's answer ends the run. Once
    through chat completions, once through ``/v1/responses`` (the SDK's default model)."""
    import subprocess
    import sys

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                    "openai-agents"], check=True, timeout=600)
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    for api in ("chat", "responses"):
        # Run outside the repository: its root is our package, which would shadow PyPI names.
        out = subprocess.run(
            [str(venv / "bin" / "python"), str(script), f"{env.url}/v1", env.model, api],
            cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (api, out.stderr[-3000:])
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert len(result["calls"]) == 1 and result["calls"][0] in ("UTC", "CET"), api
        assert result["final"] == f"12:00 {result['calls'][0]}", api
