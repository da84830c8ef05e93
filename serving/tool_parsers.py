"""Tool calls found in a model's text, in the formats models are trained to write them.

A format reads the whole text generated so far and says which part is the answer's content and
which tool calls it holds: each call's name (once its string is complete) and the raw JSON text
of its arguments so far. Raw text, not a re-serialized object, so that what a stream sends as
argument fragments joins into exactly the ``arguments`` of the whole answer, and the text only
ever grows as the model writes. ``final`` says the text is complete: before that, a trailing
piece that could still become a call's start marker is not content yet.

Formats (``--tool-call-parser``):

- ``hermes`` (also Qwen2.5 and Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, content before the first;
- ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}`` (calls separated
  by ``;``, optionally after ``<|python_tag|>``), else it is all content;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects;
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=ARG>VALUE</parameter>...</function>
  </tool_call>``, one block per call, each value typed by the tool's schema
  (``serving.xml_tool_calls``; ``with_tools`` gives the format the schemas).

Two more serve ``tool_choice``, whose output the structured-output constraint shapes:
``required`` reads a JSON list of ``{"name", "parameters"}`` objects, and ``named_call`` reads
the whole text as the arguments of the one named function.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pagedserve.serving.xml_tool_calls import ArgTypes, arg_types, xml_call

__all__ = [
    "TOOL_CALL_PARSERS",
    "ParsedText",
    "ToolCallFormat",
    "ToolCallText",
    "detect_tool_call_parser",
    "held_back",
    "named_call",
    "required_calls",
    "tool_call_format",
]


@dataclass(slots=True)
class ToolCallText:
    name: str | None
    """None until the name's JSON string is complete."""
    arguments: str = ""
    """The arguments' raw JSON text so far (the whole of it once ``complete``)."""
    complete: bool = False


@dataclass(slots=True)
class ParsedText:
    content: str
    """The answer's text outside the tool calls (what may be sent of it, when not final)."""
    calls: list[ToolCallText] = field(default_factory=list)


_WS = " \t\r\n"


def _skip_ws(t: str, i: int) -> int:
    while i < len(t) and t[i] in _WS:
        i += 1
    return i


def _value_end(t: str, i: int) -> int | None:
    """The end of the JSON value starting at ``t[i]``; None when the text ends inside it (or,
    for a bare number or literal, at its last character: more digits may follow)."""
    if i >= len(t):
        return None
    c = t[i]
    if c == '"':
        j = i + 1
        while j < len(t):
            if t[j] == "\\":
                j += 2
            elif t[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    if c in "{[":
        depth, j, in_str = 0, i, False
        while j < len(t):
            ch = t[j]
            if in_str:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    m = re.compile(r"[^,}\]\s]+").match(t, i)
    return m.end() if m and m.end() < len(t) else None


def _call_object(
    t: str, i: int, args_keys: tuple[str, ...], final: bool
) -> tuple[ToolCallText, int | None] | None:
    """The call written as the JSON object at ``t[i]`` (``{``) and the index after it (None
    when the text ends inside it: a call cut short keeps what it has); None when it is not
    such an object."""
    call = ToolCallText(None)
    j = i + 1
    while True:
        j = _skip_ws(t, j)
        if j >= len(t):
            return call, None
        if t[j] == "}":
            call.complete = call.name is not None
            return (call, j + 1) if call.complete else None
        if t[j] == ",":
            j += 1
            continue
        if t[j] != '"':
            return None
        key_end = _value_end(t, j)
        if key_end is None:
            return call, None
        key = json.loads(t[j:key_end])
        j = _skip_ws(t, key_end)
        if j >= len(t):
            return call, None
        if t[j] != ":":
            return None
        j = _skip_ws(t, j + 1)
        end = _value_end(t, j)
        if end is None and final and j < len(t) and t[j] not in '"{[':
            end = len(t)  # a bare number or literal that ends the text
        if key == "name":
            if end is None:
                return call, None
            name = json.loads(t[j:end])
            if not isinstance(name, str):
                return None
            call.name = name
        elif key in args_keys:
            if t[j:j + 1] == '"':  # arguments written as a JSON string: sent once whole
                if end is not None:
                    call.arguments = json.loads(t[j:end])
            else:
                call.arguments = t[j:end] if end is not None else t[j:]
        if end is None:
            return call, None
        j = end


def _calls_list(t: str, i: int, args_keys: tuple[str, ...], final: bool) -> list[ToolCallText]:
    """The calls of the JSON list at ``t[i]`` (``[``), as far as the text goes."""
    calls: list[ToolCallText] = []
    j = i + 1
    while True:
        j = _skip_ws(t, j)
        if j >= len(t) or t[j] == "]":
            return calls
        if t[j] == ",":
            j += 1
            continue
        if t[j] != "{":
            return calls
        found = _call_object(t, j, args_keys, final)
        if found is None:
            return calls
        call, end = found
        calls.append(call)
        if end is None:
            return calls
        j = end


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could start ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """How one family of models writes its tool calls."""

    name: str
    marker: str | None = None
    """What opens a call (``<tool_call>``) or the list of calls (``[TOOL_CALLS]``); None for a
    format whose whole text is the calls or the content."""
    end_marker: str | None = None
    """What closes each call (``</tool_call>``): one block per call."""
    args_keys: tuple[str, ...] = ("arguments",)
    as_list: bool = False
    """After the marker comes a JSON list of calls (else one object per block)."""
    function: str | None = None
    """The whole text is the arguments of this function (``tool_choice`` naming it)."""
    xml: bool = False
    """Each block holds one ``<function=NAME>`` of ``<parameter=ARG>`` values, not JSON."""
    types: ArgTypes = field(default_factory=dict, compare=False, hash=False)
    """For ``xml``: per function, its arguments' schemas (what each value's text becomes)."""

    def with_tools(self, tools: Sequence[Mapping[str, Any]]) -> ToolCallFormat:
        """This format for a request's tools (OpenAI's definitions): the XML format types
        its values by their schemas; a JSON format's calls carry their own types."""
        return replace(self, types=arg_types(tools)) if self.xml else self

    def parse(self, text: str, final: bool) -> ParsedText:
        if self.function is not None:
            return ParsedText("", [ToolCallText(self.function, text, final)])
        if self.marker is None:
            return self._parse_whole(text, final)
        start = text.find(self.marker)
        if start < 0:
            keep = 0 if final else held_back(text, self.marker)
            return ParsedText(text[: len(text) - keep])
        content = text[:start].rstrip()
        calls: list[ToolCallText] = []
        j = start + len(self.marker)
        while True:
            j = _skip_ws(text, j)
            if self.as_list:
                if text[j:j + 1] == "[":
                    calls = _calls_list(text, j, self.args_keys, final)
                return ParsedText(content, calls)
            found = self._block(text, j, final)
            if found is None:
                return ParsedText(content, calls)
            call, end = found
            calls.append(call)
            if end is None or self.end_marker is None:
                return ParsedText(content, calls)
            nxt = text.find(self.marker, end)
            if nxt < 0:
                return ParsedText(content, calls)
            j = nxt + len(self.marker)

    def _block(self, text: str, j: int, final: bool) -> tuple[ToolCallText, int | None] | None:
        """The call written at ``text[j]``, after the marker, and the index after it."""
        if self.xml:
            found = xml_call(text, j, self.types, final)
            if found is None:
                return None
            name, arguments, end = found
            return ToolCallText(name, arguments, end is not None), end
        if text[j:j + 1] != "{":
            return None
        return _call_object(text, j, self.args_keys, final)

    def _parse_whole(self, text: str, final: bool) -> ParsedText:
        """A text that is either all calls (it opens with ``{`` or the list) or all content
        (also when, complete, it names no function)."""
        parsed = self._calls_or_content(text, final)
        if final and parsed.calls and not any(c.name for c in parsed.calls):
            return ParsedText(text)
        return parsed

    def _calls_or_content(self, text: str, final: bool) -> ParsedText:
        j = _skip_ws(text, 0)
        if text.startswith("<|python_tag|>", j):
            j = _skip_ws(text, j + len("<|python_tag|>"))
        elif not final and "<|python_tag|>".startswith(text[j:]) and j < len(text):
            return ParsedText("")
        if j >= len(text):
            return ParsedText("" if not final else text)
        if self.as_list:
            if text[j] != "[":
                return ParsedText(text)
            calls = _calls_list(text, j, self.args_keys, final)
            return ParsedText("", calls) if calls or not final else ParsedText(text)
        if text[j] != "{":
            return ParsedText(text)
        calls = []
        while True:
            found = _call_object(text, j, self.args_keys, final)
            if found is None:
                return ParsedText("", calls) if calls or not final else ParsedText(text)
            call, end = found
            calls.append(call)
            if end is None:
                return ParsedText("", calls)
            j = _skip_ws(text, end)
            if text[j:j + 1] != ";":
                return ParsedText("", calls)
            j = _skip_ws(text, j + 1)
            if j >= len(text) or text[j] != "{":
                return ParsedText("", calls)


TOOL_CALL_PARSERS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat("hermes", "<tool_call>", "</tool_call>"),
    "llama3_json": ToolCallFormat("llama3_json", args_keys=("parameters", "arguments")),
    "mistral": ToolCallFormat("mistral", "[TOOL_CALLS]", as_list=True),
    "qwen3_coder": ToolCallFormat("qwen3_coder", "<tool_call>", "</tool_call>", xml=True),
}
TOOL_CALL_PARSERS["qwen"] = TOOL_CALL_PARSERS["hermes"]  # Qwen2.5 and Qwen3 write Hermes calls

required_calls = ToolCallFormat("required", args_keys=("parameters",), as_list=True)


def named_call(function: str) -> ToolCallFormat:
    return ToolCallFormat("named", function=function)


def tool_call_format(name: str) -> ToolCallFormat:
    try:
        return TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; one of "
                         f"{', '.join(sorted(TOOL_CALL_PARSERS))}") from None


def detect_tool_call_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's own tool-call syntax asks for, if it shows one."""
    if not chat_template:
        return None
    # Qwen3-Coder's template also writes <tool_call>, around its XML: ask for that first.
    if "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or '"parameters":' in chat_template:
        return "llama3_json"
    return None
