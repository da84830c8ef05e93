"""``LLM.chat`` with ``tools`` and ``tool_choice``, in-process on a tiny random Llama: the tools
reach the chat template, ``required`` and a named function give calls whose arguments validate
against the function's schema (checked with ``jsonschema``) whatever the random model draws,
and ``auto`` reads the calls the model writes (a regex constraint makes it write one)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from helpers.checkpoints import make_checkpoint

from pagedserve import LLM, SamplingParams
from pagedserve.messages import StructuredOutputsParams
from pagedserve.serving.tool_plan import ToolChoiceError

TEMPLATE = (
    "{{ bos_token }}{% for t in tools or [] %}{{ t['function']['name'] }}: "
    "{{ t['function']['description'] }}\n{% endfor %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
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
           ("required", SamplingParams(structured_outputs=StructuredOutputsParams(regex="x"))),
           ("auto", None)]  # a template without a call syntax and no parser
    for choice, params in bad:
        with pytest.raises(ToolChoiceError) as info:
            llm.chat(ASK, params, chat_template=TEMPLATE, tools=TOOLS, tool_choice=choice)
        assert info.value.param == "tool_choice"
    with pytest.raises(ToolChoiceError) as info:
        llm.chat(ASK, chat_template=TEMPLATE, tools=TOOLS * 2, tool_choice="required")
    assert info.value.param == "tools"
