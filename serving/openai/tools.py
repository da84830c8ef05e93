"""Tool calling on ``/v1/chat/completions``: what ``tools`` and ``tool_choice`` ask of the
prompt, the constraint and the answer.

The tools go to the chat template (transformers renders them as the model was trained to see
them). ``tool_choice``:

- ``none``: the tools are shown, the answer is plain content;
- ``auto`` (the default with tools): the model chooses, and the server's tool-call parser
  (``--tool-call-parser``, else the one the template's syntax shows) reads its calls from the
  text;
- ``required``: the structured-output constraint makes the answer a JSON list of one or more
  ``{"name", "parameters"}`` calls of the given tools, each against its function's schema;
- a named function: the constraint makes the whole answer that function's arguments.

So under ``required`` and a named function the arguments always parse and follow the schema,
whatever the model. ``ChatText`` turns a completion's text into the message, or into stream
deltas as OpenAI streams them: a call's id, type and name first, then its argument fragments
(and a thinking model's reasoning, split off by ``--reasoning-parser``, as
``reasoning_content``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedserve.messages import StructuredOutputsParams
from pagedserve.serving.openai.api_errors import APIError
from pagedserve.serving.openai.protocol import ChatCompletionRequest, ChatMessage, ChatTool
from pagedserve.serving.reasoning_parsers import ReasoningFormat
from pagedserve.serving.tool_parsers import (
    ParsedText,
    ToolCallFormat,
    detect_tool_call_parser,
    named_call,
    required_calls,
    tool_call_format,
)

__all__ = ["ChatText", "ToolPlan", "message_dict", "plan_tools", "template_tools"]

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: list[dict[str, Any]] | None
    """For the chat template (None: no tools given)."""
    constraint: StructuredOutputsParams | None = None
    fmt: ToolCallFormat | None = None
    """How to read calls from the answer (None: it is all content)."""


def plan_tools(body: ChatCompletionRequest, parser: str | None,
               chat_template: str | None) -> ToolPlan:
    """The plan for ``body``'s tools; ``parser`` is the server's ``--tool-call-parser`` (None:
    detect it from ``chat_template``). Raises ``APIError`` naming the field at fault."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan(None)
    tools = template_tools(body.tools)
    functions = {t.function.name: t.function for t in body.tools}
    if len(functions) != len(body.tools):
        raise APIError(400, "tools name the same function twice", param="tools")
    if choice == "none":
        return ToolPlan(tools)
    if choice is None or choice == "auto":
        name = parser or detect_tool_call_parser(chat_template)
        if name is None:
            raise APIError(
                400, "tool_choice auto needs a tool-call parser: start the server with "
                "--tool-call-parser (this model's chat template shows no known call syntax); "
                "tool_choice required or a named function work without one",
                param="tool_choice")
        return ToolPlan(tools, fmt=tool_call_format(name))
    if choice == "required":
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {
                "name": {"const": f.name}, "parameters": f.parameters or _ANY_OBJECT},
             "required": ["name", "parameters"], "additionalProperties": False}
            for f in functions.values()]}}
        if body.parallel_tool_calls is False:
            calls["maxItems"] = 1
        return ToolPlan(tools, _constraint(calls), required_calls)
    fn = functions.get(choice.function.name)
    if fn is None:
        raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among "
                       "the tools", param="tool_choice")
    return ToolPlan(tools, _constraint(fn.parameters or _ANY_OBJECT), named_call(fn.name))


def template_tools(tools: list[ChatTool]) -> list[dict[str, Any]]:
    """OpenAI's function definitions as the chat template takes them."""
    return [t.model_dump(exclude_none=True) for t in tools]


def _constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    # Compact JSON: a model that may write any whitespace can also fail to stop writing it.
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def message_dict(m: ChatMessage) -> dict[str, Any]:
    """A request message as the chat template takes it: a call's arguments as an object
    (templates write them with ``tojson``), a tool result with its call's id."""
    msg: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name is not None:
        msg["name"] = m.name
    if m.tool_calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": c.type,
             "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    return msg


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise APIError(400, f"a tool call's arguments are not JSON: {text[:60]!r}",
                       param="messages") from None


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ChatText:
    """One completion's text read as a chat answer: its reasoning (with a reasoning format),
    then its content and the tool calls a tool plan's format finds in it."""

    fmt: ToolCallFormat | None
    reasoning: ReasoningFormat | None = None
    show_reasoning: bool = True
    """False (``include_reasoning: false``): the reasoning is split off and dropped."""
    text: str = ""
    _reasoning_sent: int = 0
    _content_sent: int = 0
    _ids: list[str] = field(default_factory=list)
    _args_sent: list[int] = field(default_factory=list)

    def _parts(self, text: str, final: bool) -> tuple[str, ParsedText]:
        reasoning, answer = ("", text) if self.reasoning is None else (
            self.reasoning.split(text, final))
        if answer is None:
            return reasoning, ParsedText("")
        return reasoning, ParsedText(answer) if self.fmt is None else self.fmt.parse(answer, final)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole answer's message and its finish reason (``tool_calls`` when it calls)."""
        reasoning, parsed = self._parts(text, True)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if self.reasoning is not None and self.show_reasoning:
            message["reasoning_content"] = reasoning or None
        calls = [c for c in parsed.calls if c.name is not None]
        if not calls:
            return message, finish_reason
        message["content"] = parsed.content or None
        message["tool_calls"] = [
            {"id": _call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return message, self._called(finish_reason)

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The stream delta for ``text`` (new since the last call): reasoning, content that
        can no longer turn out to be a marker or open a call, a call's header once its name is
        complete, then its argument fragments; and the finish reason."""
        if self.fmt is None and self.reasoning is None:
            return ({"content": text} if text else {}), finish_reason
        self.text += text
        final = finish_reason is not None
        reasoning, parsed = self._parts(self.text, final)
        out: dict[str, Any] = {}
        if len(reasoning) > self._reasoning_sent:
            if self.show_reasoning:
                out["reasoning_content"] = reasoning[self._reasoning_sent:]
            self._reasoning_sent = len(reasoning)
        # Whitespace that a call may follow is held back: the whole answer's content drops it.
        content = parsed.content
        if not (final or parsed.calls or self.fmt is None):
            content = content.rstrip()
        if len(content) > self._content_sent:
            out["content"] = content[self._content_sent:]
            self._content_sent = len(content)
        calls: list[dict[str, Any]] = []
        for k, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if k == len(self._ids):
                self._ids.append(_call_id())
                self._args_sent.append(0)
                calls.append({"index": k, "id": self._ids[k], "type": "function",
                              "function": {"name": call.name, "arguments": ""}})
            if len(call.arguments) > self._args_sent[k]:
                piece = call.arguments[self._args_sent[k]:]
                self._args_sent[k] = len(call.arguments)
                if calls and calls[-1]["index"] == k:
                    calls[-1]["function"]["arguments"] += piece
                else:
                    calls.append({"index": k, "function": {"arguments": piece}})
        if calls:
            out["tool_calls"] = calls
        return out, self._called(finish_reason) if self._ids else finish_reason

    def _called(self, finish_reason: str | None) -> str | None:
        """An answer that calls tools stops for them (``tool_calls``), as OpenAI's do; a
        forced call of a named function keeps ``stop``, as OpenAI's does."""
        named = self.fmt is not None and self.fmt.function is not None
        return "tool_calls" if finish_reason == "stop" and not named else finish_reason
