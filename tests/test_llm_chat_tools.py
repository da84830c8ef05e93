"""``LLM.chat`` with ``tools`` and ``tool_choice``, in-process on a tiny random Llama: the tools
reach the chat template, ``required`` and a named function give calls whose arguments validate
against the function's schema (checked with ``jsonschema``) whatever the random model draws,
and ``auto`` reads the calls the model writes (a regex constraint makes it write one). A call
goes back through ``LLM.chat`` with its result, rendered as the server renders the same
history."""

from __future__ import annotations

import copy
import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
from helpers.checkpoints import make_checkpoint

from pagedserve import LLM, SamplingParams
from pagedserve.controller.tokenizer import Tokenizer
from pagedserve.messages import StructuredOutputsParams
from pagedserve.serving.chat import ChatError
from pagedserve.serving.openai.api_errors import APIError
from pagedserve.serving.openai.prepare import render_chat as server_render
from pagedserve.serving.openai.protocol import ChatCompletionRequest, ChatMessage
from pagedserve.serving.openai.tools import plan_tools as server_plan
from pagedserve.serving.tool_plan import ToolChoiceError

TEMPLATE = (
    "{{ bos_token }}{% for t in tools or [] %}{{ t['function']['name'] }}: "
    "{{ t['function']['description'] }}\n{% endfor %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Renders a call history as Hermes does: calls with their arguments as JSON, results by call id.
HISTORY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}<|tool|>\n"
    "[{{ m['tool_call_id'] }}] {{ m['content'] }}\n{% else %}<|{{ m['role'] }}|>\n"
    "{{ m['content'] }}{% for c in m['tool_calls'] or [] %}<tool_call>{\"name\": "
    "\"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "</tool_call>{% endfor %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Clock.",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    ckpt = make_checkpoint("llama", Path(tmp_path_factory.mktemp("chat_tools")) / "llama")
    with LLM(str(ckpt), backend="local", max_model_len=512, num_gpu_blocks=128) as engine:
        yield engine


def _chat(llm: LLM, max_tokens: int, **kw):
    """Three sampled replies (three seeds) to the same question."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s) for s in range(3)]
    return llm.chat([ASK] * 3, params, chat_template=TEMPLATE, tools=TOOLS, **kw)


def test_a_named_function_gets_arguments_that_follow_its_schema(llm) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    outs = _chat(llm, 48, tool_choice=named)
    for out in outs:
        assert "get_weather: Forecast.\nget_time: Clock." in out.prompt
        (comp,) = out.outputs
        assert comp.finish_reason == "stop"
        (call,) = comp.tool_calls
        assert call["name"] == "get_weather" and call["id"].startswith("call_")
        assert call["arguments"] == comp.text
        jsonschema.validate(json.loads(call["arguments"]), WEATHER)


def test_required_calls_name_given_tools_and_follow_their_schemas(llm) -> None:
    outs = _chat(llm, 200, tool_choice="required", parallel_tool_calls=False)
    for out in outs:
        (call,) = out.outputs[0].tool_calls  # parallel_tool_calls=False: exactly one
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_auto_reads_the_calls_the_model_writes_and_none_reads_none(llm) -> None:
    # The regex makes the random model write a Qwen3-Coder XML call, read by that parser.
    regex = (r"On it\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|Rome)\n"
             r"</parameter>\n<parameter=days>\n[1-7]\n</parameter>\n</function>\n</tool_call>")
    params = SamplingParams(max_tokens=160, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(regex=regex))
    (out,) = llm.chat(ASK, params, chat_template=TEMPLATE, tools=TOOLS,
                      tool_call_parser="qwen3_coder")
    (call,) = out.outputs[0].tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)  # days is an integer
    (plain,) = llm.chat(ASK, params, chat_template=TEMPLATE, tools=TOOLS, tool_choice="none")
    assert plain.outputs[0].tool_calls is None and plain.outputs[0].text == out.outputs[0].text


def test_tool_requests_that_cannot_be_served_are_refused_by_name(llm) -> None:
    bad = [({"type": "function", "function": {"name": "nope"}}, None),
           ("required", SamplingParams(structured_outputs=StructuredOutputsParams(regex="x")))]
    for choice, params in bad:
        with pytest.raises(ToolChoiceError) as info:
            llm.chat(ASK, params, chat_template=TEMPLATE, tools=TOOLS, tool_choice=choice)
        assert info.value.param == "tool_choice"
    with pytest.raises(ToolChoiceError) as info:
        llm.chat(ASK, chat_template=TEMPLATE, tools=TOOLS * 2, tool_choice="required")
    assert info.value.param == "tools"


def test_a_call_and_its_result_go_back_through_chat_as_the_server_renders_them(llm) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    greedy = SamplingParams(max_tokens=48, temperature=0.0)
    (first,) = llm.chat(ASK, greedy, chat_template=HISTORY_TEMPLATE, tools=TOOLS,
                        tool_choice=named)
    (call,) = first.outputs[0].tool_calls
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"],
         "content": [{"type": "text", "text": "18"}, {"type": "text", "text": "C"}]},
    ]
    (second,) = llm.chat(history, SamplingParams(max_tokens=4), chat_template=HISTORY_TEMPLATE,
                         tools=TOOLS, tool_choice="none")
    arguments = json.dumps(json.loads(call["arguments"]))  # the template's tojson of them
    # (No newline after </tool_call>: the template's {% endfor %} eats it, trim_blocks.)
    assert second.prompt.endswith(
        f'<|assistant|>\n<tool_call>{{"name": "get_weather", "arguments": {arguments}}}'
        f"</tool_call><|tool|>\n[{call['id']}] 18C\n<|assistant|>\n")
    # The server's chat endpoint renders the same history to the same prompt, token for token.
    hf = copy.copy(llm.tokenizer.hf)
    hf.chat_template = HISTORY_TEMPLATE  # the server renders with the model's own template
    client = SimpleNamespace(tokenizer=Tokenizer(hf))
    served = server_render(client, [ChatMessage.model_validate(m) for m in history])
    assert (served.text, served.token_ids) == (second.prompt, second.prompt_token_ids)


def test_malformed_tool_history_is_refused_naming_the_message(llm) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{not json"}}
    bad = [({"role": "assistant", "content": None, "tool_calls": [call]},
            "messages[1].tool_calls[0]: a tool call's arguments are not JSON"),
           ({"role": "assistant", "tool_calls": [{"id": "call_1"}]},
            "messages[1].tool_calls[0] must be"),
           ({"role": "tool", "tool_call_id": 7, "content": "18C"},
            "messages[1].tool_call_id must be a string"),
           ({"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
            "messages[1].content must be")]
    for message, error in bad:
        with pytest.raises(ChatError, match=re.escape(error)):
            llm.chat([*ASK, message], chat_template=HISTORY_TEMPLATE)


def test_auto_without_a_call_format_renders_the_tools_and_reads_none(llm, caplog) -> None:
    """As vLLM's ``chat``: TEMPLATE shows no call syntax and no parser is named, so the tools
    are rendered and no calls read (said once in the log); the server still refuses, since its
    clients act on parsed calls."""
    caplog.set_level(logging.INFO, logger="pagedserve.serving.llm")
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    (plain,) = llm.chat(ASK, greedy, chat_template=TEMPLATE, tools=TOOLS, tool_choice="none")
    for choice in ("auto", None):  # None: auto, the default with tools
        (out,) = llm.chat(ASK, greedy, chat_template=TEMPLATE, tools=TOOLS, tool_choice=choice)
        assert "get_weather: Forecast.\nget_time: Clock." in out.prompt
        assert out.outputs[0].tool_calls is None
        assert out.outputs[0].text == plain.outputs[0].text
    told = [r for r in caplog.records if "reads no tool calls" in r.getMessage()]
    assert [r.levelno for r in told] == [logging.INFO]
    with pytest.raises(APIError) as info:
        server_plan(ChatCompletionRequest(messages=ASK, tools=TOOLS), None, TEMPLATE)
    assert (info.value.status, info.value.param) == (400, "tool_choice")
    assert "--tool-call-parser" in info.value.message
