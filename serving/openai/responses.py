"""``POST /v1/responses``: a Responses call run as the chat completion it amounts to.

``chat_request`` turns the body into a ``ChatCompletionRequest`` (instructions as the first
system message, items as messages, function call items as an assistant's ``tool_calls`` and
their outputs as ``tool`` messages, flat function tools as chat tools, ``text.format`` as
``response_format``), and ``prepare_chat`` runs it: the chat template, tool choice and
structured-output constraint are the chat path's own. ``ResponsesEndpoint`` answers in the
Responses shape (``responses_output``), whole or streamed; an error the chat path raises names
the Responses field (``input``, not ``messages``).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.serving.openai.api_errors import APIError
from pagedserve.serving.openai.endpoint import Endpoint
from pagedserve.serving.openai.engine_run import EngineRun, ServerContext
from pagedserve.serving.openai.prepare import prepare_chat
from pagedserve.serving.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    NamedToolChoice,
    ToolCall,
    ToolChoiceFunction,
)
from pagedserve.serving.openai.responses_output import (
    ResponseEvents,
    ResponseShape,
    TextLogprobs,
    usage,
)
from pagedserve.serving.openai.responses_protocol import (
    OUTPUT_TEXT_LOGPROBS,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    InputMessage,
    JSONSchemaTextFormat,
    ReasoningItem,
    ResponsesRequest,
)
from pagedserve.serving.openai.tools import ChatText
from pagedserve.serving.request_fields import ResponseFormat, StructuredOutputs

__all__ = ["ResponsesEndpoint", "chat_request", "prepare_responses"]

# The chat fields an error of the chat path may name, by the Responses field they came from.
_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "logprobs": "include",
           "response_format": "text.format", "response_format.json_schema": "text.format"}
# In messages too; a schema the grammar compiler refuses is named as the engine sees it.
_WORDS = {**_FIELDS, "structured_outputs.json": "text.format.schema"}
_FIELD_WORDS = re.compile(r"\b(structured_outputs\.json|messages|max_completion_tokens|"
                          r"response_format(?:\.json_schema)?)\b")


def chat_request(body: ResponsesRequest, request_id: str) -> ChatCompletionRequest:
    """The chat completion request ``body`` amounts to; its engine request is
    ``chatcmpl-<request_id>``."""
    fmt = body.text.format if body.text is not None else None
    response_format = structured = None
    if fmt is not None and fmt.type != "text":
        schema = None
        if isinstance(fmt, JSONSchemaTextFormat):
            schema = {"name": fmt.name, "schema": fmt.json_schema,
                      "description": fmt.description, "strict": fmt.strict}
        response_format = ResponseFormat.model_validate({"type": fmt.type, "json_schema": schema})
        # Compact JSON, as tool arguments are: a model free to write any whitespace can also
        # fail to stop writing it, and text.format has no option to say otherwise.
        structured = StructuredOutputs(disable_any_whitespace=True)
    choice: Any = body.tool_choice
    if isinstance(choice, FunctionToolChoice):
        choice = NamedToolChoice(type="function", function=ToolChoiceFunction(name=choice.name))
    tools = None
    if body.tools is not None:
        tools = [ChatTool(type="function", function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
            for t in body.tools]
    # As OpenAI: top_logprobs shows only in the logprobs that include asks for.
    logprobs = OUTPUT_TEXT_LOGPROBS in (body.include or ())
    return ChatCompletionRequest(
        model=body.model, messages=_messages(body), max_completion_tokens=body.max_output_tokens,
        logprobs=logprobs, top_logprobs=body.top_logprobs if logprobs else None,
        temperature=body.temperature, top_p=body.top_p, stream=body.stream, tools=tools,
        tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format, structured_outputs=structured, user=body.user,
        safety_identifier=body.safety_identifier, request_id=request_id,
    )


def _messages(body: ResponsesRequest) -> list[ChatMessage]:
    chat: list[ChatMessage] = []
    if body.instructions is not None:
        chat.append(ChatMessage(role="system", content=body.instructions))
    items = ([InputMessage(role="user", content=body.input)] if isinstance(body.input, str)
             else body.input)
    names: dict[str, str] = {}  # call id -> the function called
    for i, item in enumerate(items):
        if isinstance(item, InputMessage):
            chat.append(ChatMessage(role=item.role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            call = ToolCall(id=item.call_id,
                            function=FunctionCall(name=item.name, arguments=item.arguments))
            last = chat[-1] if chat else None
            # The calls of one turn are one assistant message, after its text if it had any.
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                chat.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in names:
                raise APIError(400, f"input[{i}] answers the call {item.call_id[:40]!r}, which "
                               "no function_call item before it made", param="input")
            chat.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                    name=names[item.call_id], content=item.text()))
        else:
            assert isinstance(item, ReasoningItem)  # left out of the prompt (its docstring)
    if not chat:
        raise APIError(400, "input is empty: give text, or at least one message",
                       param="input")
    return chat


def _renamed(exc: APIError) -> APIError:
    """``exc`` naming the Responses fields instead of the chat fields they became."""
    param = _FIELDS.get(exc.param or "", exc.param)
    message = _FIELD_WORDS.sub(lambda m: _WORDS[m.group(1)], exc.message)
    if (param, message) == (exc.param, exc.message):
        return exc
    return APIError(exc.status, message, type=exc.type, param=param, code=exc.code,
                    retry_after_s=exc.retry_after_s)


async def prepare_responses(ctx: ServerContext, body: ResponsesRequest) -> ResponsesEndpoint:
    key = uuid.uuid4().hex
    try:
        chat = await prepare_chat(ctx, chat_request(body, key))
    except APIError as exc:
        raise _renamed(exc) from exc
    return ResponsesEndpoint(chat, ResponseShape(f"resp_{key}", chat.created, chat.model, body))


@dataclass
class ResponsesEndpoint:
    """A prepared Responses call: its chat endpoint's run, answered in the Responses shape."""

    chat: Endpoint
    shape: ResponseShape

    @property
    def stream(self) -> bool:
        return self.chat.stream

    @property
    def run(self) -> EngineRun:
        return self.chat.run

    async def respond(self, is_disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any]:
        (choice,) = (await self.chat.respond(is_disconnected))["choices"]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        logprobs = (choice["logprobs"] or {}).get("content")
        return self.shape.response(
            status, self.shape.output(choice["message"], status, logprobs), usage(self.run))

    async def stream_events(self) -> AsyncIterator[str]:
        events = ResponseEvents(self.shape)
        text = ChatText(self.chat.tool_calls, self.chat.reasoning, self.chat.show_reasoning)
        tokens = TextLogprobs() if self.chat.top_n is not None else None
        for event in events.start():
            yield event
        reason = None
        try:
            async for _ in self.run.updates():
                new, finish = "", None
                for delta in self.run.take_pending(0):
                    for d in delta.completions:
                        new += d.text
                        finish = d.finish_reason or finish
                        if tokens is not None and d.logprobs:
                            tokens.add(self.chat.chat_logprobs(list(d.logprobs)))
                if not new and finish is None:
                    continue
                out, reason = text.delta(new, finish)
                logprobs = None
                if tokens is not None:
                    tokens.take(out.get("reasoning_content", ""))  # passed over
                    logprobs = tokens.take(out.get("content", ""))
                for event in events.delta(out, logprobs):
                    yield event
        except APIError as exc:
            for event in events.fail(exc):
                yield event
            return
        for event in events.finish(usage(self.run), reason == "length"):
            yield event
