"""Qwen3-Coder's XML tool calls (``--tool-call-parser qwen3_coder``): whole and streamed in any
pieces, each value typed by the tool's schema, and the template that asks for the format."""

from __future__ import annotations

import json
import random

import pytest

from pagedserve.serving.openai.tools import ChatText
from pagedserve.serving.tool_parsers import detect_tool_call_parser, tool_call_format
from pagedserve.serving.xml_tool_calls import convert

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
    "metric": {"type": "boolean"}, "where": {"type": "object"}, "tags": {"type": "array"},
    "limit": {"type": ["integer", "null"]}, "zip": {"anyOf": [{"type": "string"}]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}}}}}]
FMT = tool_call_format("qwen3_coder").with_tools(TOOLS)

TEXT = (
    "Let me check both.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
    "<parameter=metric>\ntrue\n</parameter>\n<parameter=where>\n{\"lat\": 40.7, \"tag\": "
    "\"a<b\"}\n</parameter>\n<parameter=tags>\n[\"x\", 2]\n</parameter>\n<parameter=zip>\n"
    "01234\n</parameter>\n<parameter=limit>\nnull\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n<parameter=zone>\nline one\n  line \"two\"\n"
    "</parameter>\n</function>\n</tool_call>"
)
CALLS = [
    ("get_weather", {"city": "New York", "days": 3, "ratio": 0.5, "metric": True,
                     "where": {"lat": 40.7, "tag": "a<b"}, "tags": ["x", 2], "zip": "01234",
                     "limit": None}),
    ("get_time", {"zone": 'line one\n  line "two"'}),
]


def _stream(text: str, cuts: list[int]) -> tuple[str, list[list[str]], list[str | None]]:
    chat = ChatText(FMT)
    bounds = [0, *cuts, len(text)]
    content, calls, reasons = "", [], []
    for k in range(len(bounds) - 1):
        last = k == len(bounds) - 2
        delta, reason = chat.delta(text[bounds[k]:bounds[k + 1]], "stop" if last else None)
        reasons.append(reason)
        content += delta.get("content", "")
        for c in delta.get("tool_calls", []):
            if "id" in c:  # the name comes first, in the call's opening delta
                assert c["index"] == len(calls)
                calls.append([c["function"]["name"], ""])
            calls[c["index"]][1] += c["function"]["arguments"]
    return content, calls, reasons


def test_the_whole_answer_keeps_its_content_and_types_every_value() -> None:
    message, reason = ChatText(FMT).message(TEXT, "stop")
    assert message["content"] == "Let me check both." and reason == "tool_calls"
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
           for c in message["tool_calls"]]
    assert got == CALLS


def test_any_chunking_streams_the_name_first_and_arguments_that_add_up() -> None:
    message, _ = ChatText(FMT).message(TEXT, "stop")
    whole = [[c["function"]["name"], c["function"]["arguments"]] for c in message["tool_calls"]]
    rng = random.Random(0)
    chunkings = [list(range(size, len(TEXT), size)) for size in (1, 2, 3, 7, 13)]
    chunkings += [sorted(rng.sample(range(1, len(TEXT)), rng.randint(1, 40))) for _ in range(30)]
    for cuts in chunkings:
        content, calls, reasons = _stream(TEXT, cuts)
        assert content == "Let me check both.", cuts
        assert calls == whole, cuts
        assert reasons[-1] == "tool_calls" and not any(reasons[:-1])


def test_a_partial_marker_is_held_back_and_plain_text_stays_content() -> None:
    chat = ChatText(FMT)
    assert chat.delta("Hi <tool_", None)[0] == {"content": "Hi"}
    assert chat.delta("box> and <function=x> prose", "stop")[0] == {
        "content": " <tool_box> and <function=x> prose"}


def test_a_call_cut_short_closes_what_it_has() -> None:
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n<parameter=ci"
    parsed = FMT.parse(text, final=False)
    assert parsed.calls[0].arguments == '{"days": 2' and not parsed.calls[0].complete
    assert FMT.parse(text, final=True).calls[0].arguments == '{"days": 2}'
    # A forgotten </parameter>: the value ends where the next parameter or </function> begins.
    sloppy = ("<tool_call><function=get_weather><parameter=days>4<parameter=city>Oslo"
              "</function></tool_call>")
    (call,) = FMT.parse(sloppy, final=True).calls
    assert json.loads(call.arguments) == {"days": 4, "city": "Oslo"} and call.complete


@pytest.mark.parametrize(("value", "schema", "expected"), [
    ("42", {"type": "string"}, "42"),
    ("42", None, "42"),  # no declared type: text, as the model wrote it
    ("42", {"type": "integer"}, 42),
    ("-1.5e2", {"type": "number"}, -150.0),
    ("false", {"type": "boolean"}, False),
    ("True", {"type": "boolean"}, True),
    ('{"a": [1, null]}', {"type": "object"}, {"a": [1, None]}),
    ("[1, 2]", {"type": "array"}, [1, 2]),
    ("null", {"type": ["integer", "null"]}, None),
    ("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 7),
    ("twelve", {"type": "integer"}, "twelve"),  # does not parse: the text stays
    ("{broken", {"type": "object"}, "{broken"),
])
def test_values_become_the_type_the_schema_declares(value, schema, expected) -> None:
    assert convert(value, schema) == expected


def test_the_format_is_detected_from_a_template_that_writes_it() -> None:
    qwen3_coder = ("{%- if tools %}...<function=example_function_name>\n<parameter="
                   "example_parameter_1>\nvalue_1\n</parameter>...{%- endif %}"
                   "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}")
    assert detect_tool_call_parser(qwen3_coder) == "qwen3_coder"
    assert detect_tool_call_parser("<tool_call>{{ tool_call | tojson }}</tool_call>") == "hermes"
