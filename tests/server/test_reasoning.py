"""``--reasoning-parser``: a thinking model's reasoning comes back as ``reasoning_content``,
apart from ``content``, streamed and not. A regex constraint makes the tiny random model write
a think block; the parser must split it as the format says."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pagedserve.serving.openai.tools import ChatText
from pagedserve.serving.reasoning_parsers import REASONING_PARSERS
from pagedserve.serving.tool_parsers import TOOL_CALL_PARSERS

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
HERMES = TOOL_CALL_PARSERS["hermes"]


@pytest.mark.parametrize(("fmt", "tools", "text", "reasoning", "content"), [
    (QWEN3, None, "<think>Paris is in France.</think>\n\nIt is Paris.", "Paris is in France.",
     "\n\nIt is Paris."),
    (QWEN3, None, "No thinking <think>here</think>.", None, "No thinking <think>here</think>."),
    (QWEN3, None, "<think>cut short", "cut short", ""),
    (R1, None, "Think first.</think>Answer.", "Think first.", "Answer."),
    (R1, None, "<think>Think first.</think>Answer.", "Think first.", "Answer."),
    (R1, None, "</think>", None, ""),
    (QWEN3, HERMES, '<think>A tool.</think><tool_call>{"name": "f", "arguments": {}}</tool_call>',
     "A tool.", None),
])
def test_reasoning_streamed_in_any_pieces_equals_the_whole(fmt, tools, text, reasoning,
                                                           content) -> None:
    message, _ = ChatText(tools, fmt).message(text, "stop")
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    for size in (1, 2, 3, 7, len(text)):
        chat = ChatText(tools, fmt)
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        got = {"reasoning_content": "", "content": ""}
        for k, piece in enumerate(pieces):
            delta, _ = chat.delta(piece, "stop" if k == len(pieces) - 1 else None)
            for key in got:
                got[key] += delta.get(key, "")
        assert got == {"reasoning_content": reasoning or "", "content": content or ""}, size
    hidden, _ = ChatText(tools, fmt, show_reasoning=False).message(text, "stop")
    assert "reasoning_content" not in hidden and hidden["content"] == content


@pytest.fixture(scope="module")
def env(llama_dir: Path, srv: Any) -> Iterator[SimpleNamespace]:
    with srv.openai(llama_dir, app={"reasoning_parser": "qwen3",
                                    "tool_call_parser": "hermes"}) as e:
        yield e


THINK = r"<think>Paris is in France\.</think>It is Paris\."


def _chat(env: SimpleNamespace, **kw: Any) -> Any:
    extra = {"structured_outputs": {"regex": kw.pop("regex", THINK)}, **kw.pop("extra", {})}
    return env.oai.chat.completions.create(
        model=env.model, messages=[{"role": "user", "content": "Where?"}],
        max_tokens=kw.pop("max_tokens", 64), extra_body=extra, **kw)


def test_reasoning_content_apart_from_the_answer(env) -> None:
    msg = _chat(env).choices[0].message
    assert (msg.model_extra["reasoning_content"], msg.content) == (
        "Paris is in France.", "It is Paris.")
    reasoning = content = ""
    for chunk in _chat(env, stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == ("Paris is in France.", "It is Paris.")
    hidden = _chat(env, extra={"include_reasoning": False}).choices[0].message
    assert "reasoning_content" not in hidden.model_extra and hidden.content == "It is Paris."


def test_reasoning_then_a_tool_call(env) -> None:
    regex = (r'<think>I need the weather\.</think><tool_call>\{"name": "get_weather", '
             r'"arguments": \{"city": "Oslo"\}\}</tool_call>')
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    out = _chat(env, regex=regex, tools=tools, max_tokens=128)
    msg = out.choices[0].message
    assert msg.model_extra["reasoning_content"] == "I need the weather."
    assert msg.content is None and out.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [
        ("get_weather", '{"city": "Oslo"}')]


def test_an_unknown_parser_name_stops_the_server_from_starting(env) -> None:
    from pagedserve.serving.openai.server import build_app

    for option in ("reasoning_parser", "tool_call_parser"):
        with pytest.raises(ValueError, match="unknown"):
            build_app(env.client, **{option: "nope"})
