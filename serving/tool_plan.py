"""What a request's ``tools`` and ``tool_choice`` ask of the prompt, the constraint and the
answer: one plan for every front end (the HTTP server's chat completions and ``LLM.chat``).

The tools go to the chat template (transformers renders them as the model was trained to see
them). ``tool_choice``:

- ``none``: the tools are shown, the answer is plain content;
- ``auto`` (the default with tools): the model chooses, and a tool-call parser (the one asked
  for, else the one the template's syntax shows) reads its calls from the text. With neither,
  the server refuses (its clients act on parsed calls) while ``LLM.chat`` renders the tools
  and reads no calls, as vLLM's does (``require_parser=False``);
- ``required``: the structured-output constraint makes the answer a JSON list of one or more
  ``{"name", "parameters"}`` calls of the given tools, each against its function's schema;
- a named function (``{"type": "function", "function": {"name": ...}}``): the constraint makes
  the whole answer that function's arguments.

So under ``required`` and a named function the arguments always parse and follow the schema,
whatever the model (a function's ``strict`` changes nothing: the schema is always enforced).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.messages import StructuredOutputsParams
from pagedserve.serving.tool_parsers import (
    ToolCallFormat,
    detect_tool_call_parser,
    named_call,
    required_calls,
    tool_call_format,
)

__all__ = ["ToolChoiceError", "ToolPlan", "call_id", "plan_tools"]

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


class ToolChoiceError(ValueError):
    """``tools`` or ``tool_choice`` cannot be served; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: list[dict[str, Any]] | None
    """For the chat template (None: no tools given)."""
    constraint: StructuredOutputsParams | None = None
    fmt: ToolCallFormat | None = None
    """How to read calls from the answer (None: it is all content)."""
    unread: str | None = None
    """Why ``auto`` reads no calls (no parser asked for or shown), for the caller's log."""

    def calls(self, text: str) -> list[dict[str, str]] | None:
        """The calls a whole answer makes, as ``{"id", "name", "arguments"}`` (the arguments'
        JSON text); None when this plan reads no calls."""
        if self.fmt is None:
            return None
        return [{"id": call_id(), "name": c.name, "arguments": c.arguments}
                for c in self.fmt.parse(text, True).calls if c.name is not None]


def plan_tools(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    *,
    parser: str | None,
    chat_template: str | None,
    parallel_tool_calls: bool | None = None,
    require_parser: bool = True,
) -> ToolPlan:
    """The plan for OpenAI-style tool definitions (``{"type": "function", "function": {"name",
    "description", "parameters"}}``) and ``tool_choice``; ``parser`` names the tool-call format
    of ``auto`` (None: detect it from ``chat_template``). ``auto`` with no format to read is
    refused unless ``require_parser`` is False: then the tools are rendered and no calls read
    (``ToolPlan.unread`` says why). Raises ``ToolChoiceError``."""
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise ToolChoiceError("tool_choice needs tools", "tool_choice")
        return ToolPlan(None)
    template = [dict(t) for t in tools]
    functions = _functions(template)
    if tool_choice == "none":
        return ToolPlan(template)
    if tool_choice is None or tool_choice == "auto":
        name = parser or detect_tool_call_parser(chat_template)
        if name is None and not require_parser:
            return ToolPlan(template, unread=(
                "tool_choice auto reads no tool calls: no tool_call_parser was given and the "
                "chat template shows no known call syntax; the tools are rendered, and the "
                "replies are plain text (pass tool_call_parser to read calls)"))
        if name is None:
            raise ToolChoiceError(
                "tool_choice auto needs a tool-call parser (--tool-call-parser, or "
                "tool_call_parser): this model's chat template shows no known call syntax; "
                "tool_choice required or a named function work without one", "tool_choice")
        return ToolPlan(template, fmt=tool_call_format(name).with_tools(template))
    if tool_choice == "required":
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {
                "name": {"const": n}, "parameters": f.get("parameters") or _ANY_OBJECT},
             "required": ["name", "parameters"], "additionalProperties": False}
            for n, f in functions.items()]}}
        if parallel_tool_calls is False:
            calls["maxItems"] = 1
        return ToolPlan(template, _constraint(calls), required_calls)
    named = _named(tool_choice)
    fn = functions.get(named)
    if fn is None:
        raise ToolChoiceError(f"tool_choice names {named!r}, which is not among the tools",
                              "tool_choice")
    return ToolPlan(template, _constraint(fn.get("parameters") or _ANY_OBJECT), named_call(named))


def _functions(tools: list[dict[str, Any]]) -> dict[str, Mapping[str, Any]]:
    functions: dict[str, Mapping[str, Any]] = {}
    for t in tools:
        fn = t.get("function")
        if t.get("type") != "function" or not isinstance(fn, Mapping) or not isinstance(
                fn.get("name"), str):
            raise ToolChoiceError('each tool must be {"type": "function", "function": '
                                  '{"name": ...}}', "tools")
        functions[fn["name"]] = fn
    if len(functions) != len(tools):
        raise ToolChoiceError("tools name the same function twice", "tools")
    return functions


def _named(tool_choice: str | Mapping[str, Any]) -> str:
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ToolChoiceError('tool_choice must be none, auto, required or {"type": '
                              '"function", "function": {"name": ...}}', "tool_choice")
    return fn["name"]


def _constraint(schema: Mapping[str, Any]) -> StructuredOutputsParams:
    # Compact JSON: a model that may write any whitespace can also fail to stop writing it.
    return StructuredOutputsParams(json=dict(schema), disable_any_whitespace=True)
