"""Tool calling on ``/v1/chat/completions``: the request's ``tools`` and ``tool_choice`` planned
as every front end plans them (``serving.tool_plan``: the tools for the chat template, the
constraint of ``required`` and a named function, the parser of ``auto``), answered as HTTP
errors here. ``ChatText`` turns a completion's text into the message, or into stream deltas as
OpenAI streams them: a call's id, type and name first, then its argument fragments (and a
thinking model's reasoning, split off by ``--reasoning-parser``, as ``reasoning_content``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.serving.openai.api_errors import APIError
from pagedserve.serving.openai.protocol import ChatCompletionRequest, ChatTool
from pagedserve.serving.reasoning_parsers import ReasoningFormat
from pagedserve.serving.tool_parsers import ParsedText, ToolCallFormat
from pagedserve.serving.tool_plan import ToolChoiceError, ToolPlan, call_id
from pagedserve.serving.tool_plan import plan_tools as _plan_tools

__all__ = ["ChatText", "ToolPlan", "plan_tools", "template_tools"]


def plan_tools(body: ChatCompletionRequest, parser: str | None,
               chat_template: str | None) -> ToolPlan:
    """The plan for ``body``'s tools; ``parser`` is the server's ``--tool-call-parser`` (None:
    detect it from ``chat_template``). Raises ``APIError`` naming the field at fault."""
    choice = body.tool_choice
    try:
        return _plan_tools(
            template_tools(body.tools) if body.tools else None,
            choice if choice is None or isinstance(choice, str) else choice.model_dump(),
            parser=parser, chat_template=chat_template,
            parallel_tool_calls=body.parallel_tool_calls)
    except ToolChoiceError as exc:
        raise APIError(400, exc.message, param=exc.param) from None


def template_tools(tools: list[ChatTool]) -> list[dict[str, Any]]:
    """OpenAI's function definitions as the chat template takes them."""
    return [t.model_dump(exclude_none=True) for t in tools]


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
            {"id": call_id(), "type": "function",
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
                self._ids.append(call_id())
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
