"""What ``POST /v1/responses`` answers: the ``response`` object, its output items, and the
server-sent events that stream it.

Both shapes are built from a chat answer: the whole message (``ResponseShape.output``), or the
deltas ``tools.ChatText`` makes of the text as it arrives (``ResponseEvents``), so a call's
name and arguments are found exactly as ``/v1/chat/completions`` finds them. A stream opens an
item when its first piece arrives and closes every item at the end: the chat deltas may still
add to an item opened earlier (content after a call), and no piece may follow its item's
``done`` event.

With ``include: ["message.output_text.logprobs"]`` an ``output_text`` carries its tokens'
logprobs (``TextLogprobs`` finds which tokens wrote it): each entry with ``bytes`` in a part,
without them in the ``output_text`` events, as OpenAI's types have them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedserve.serving.openai.api_errors import APIError
from pagedserve.serving.openai.engine_run import EngineRun
from pagedserve.serving.openai.render import render_json
from pagedserve.serving.openai.responses_protocol import FunctionToolChoice, ResponsesRequest

__all__ = ["ResponseEvents", "ResponseShape", "TextLogprobs", "usage"]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class _Item:
    """One output item: a message, a reasoning text, or a function call."""

    kind: str
    id: str
    index: int
    text: str = ""
    """The message's or reasoning's text, or the call's arguments."""
    call_id: str = ""
    name: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    """A message's: the entries of the tokens its text came from."""

    def body(self, status: str) -> dict[str, Any]:
        if self.kind == "function_call":
            return {"id": self.id, "type": "function_call", "status": status,
                    "call_id": self.call_id, "name": self.name, "arguments": self.text}
        content = [self.part()] if status != "in_progress" else []
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "status": status, "summary": [],
                    "content": content}
        return {"id": self.id, "type": "message", "role": "assistant", "status": status,
                "content": content}

    def part(self, text: str | None = None) -> dict[str, Any]:
        """The content part: the item's own, or (``text`` given) one just opened."""
        logprobs = self.logprobs if text is None else []
        text = self.text if text is None else text
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _event_entries(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Logprob entries as the ``output_text`` events have them: no ``bytes``."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                              for t in e["top_logprobs"]]} for e in entries]


@dataclass(slots=True)
class TextLogprobs:
    """Pairs an answer's tokens (their chat ``logprobs.content`` entries, in order) with the
    pieces of message text cut from it, whole or as streamed: a piece gets the entries of
    the tokens whose text overlaps it. Tokens between pieces (reasoning, a call's markup)
    are passed over."""

    _text: str = ""
    _ends: list[int] = field(default_factory=list)
    """Where each token's text ends in ``_text``."""
    _entries: list[dict[str, Any]] = field(default_factory=list)
    _given: int = 0
    """Tokens handed out or passed over."""
    _done: int = 0
    """How much of ``_text`` the pieces so far have covered."""

    def add(self, entries: list[dict[str, Any]]) -> None:
        for entry in entries:
            self._text += entry["token"]
            self._ends.append(len(self._text))
            self._entries.append(entry)

    def take(self, piece: str) -> list[dict[str, Any]]:
        if not piece:
            return []
        start = self._text.find(piece, self._done)
        end = start + len(piece)
        if start < 0:
            # Tokens decoded one at a time need not spell the piece (a character split
            # across two of them): it gets every token not yet handed out.
            start, end = self._done, len(self._text)
        while self._given < len(self._ends) and self._ends[self._given] <= start:
            self._given += 1
        first = self._given
        while self._given < len(self._ends) and (
                self._ends[self._given - 1] if self._given else 0) < end:
            self._given += 1
        self._done = end
        return self._entries[first:self._given]


def usage(run: EngineRun) -> dict[str, Any]:
    """The Responses ``usage`` of a one-prompt, one-completion run."""
    sub = run.subs[0]
    out = sub.latest
    prompt = len(sub.prompt.token_ids)
    generated = sum(len(c.token_ids) for c in out.outputs) if out else 0
    return {
        "input_tokens": prompt,
        # Every prompt's blocks are cached as they fill, with no charge or choice to write
        # them: OpenAI's explicit cache writes do not happen here.
        "input_tokens_details": {"cached_tokens": out.num_cached_tokens if out else 0,
                                 "cache_write_tokens": 0},
        "output_tokens": generated,
        # The reasoning is not counted apart: its tokens are in output_tokens.
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """The fields of one response that the request and the call fix."""

    id: str
    created_at: int
    model: str
    body: ResponsesRequest

    def response(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format if body.text is not None else None
        choice = body.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": body.temperature, "top_p": body.top_p,
            "top_logprobs": body.top_logprobs,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)
                     if fmt is not None else {"type": "text"}},
            "tool_choice": (choice.model_dump() if isinstance(choice, FunctionToolChoice)
                            else choice or "auto"),
            "tools": [t.model_dump() for t in body.tools or ()],
            "truncation": "disabled", "usage": usage, "user": body.user,
            "metadata": body.metadata or {},
        }

    def output(self, message: dict[str, Any], status: str,
               logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The output items of a whole chat ``message``: its reasoning, its content (an empty
        message when it has neither content nor calls), then its calls. ``logprobs``: the
        chat answer's entries, when the request includes them."""
        items: list[_Item] = []
        if message.get("reasoning_content"):
            items.append(_Item("reasoning", _new_id("rs"), 0, message["reasoning_content"]))
        calls = message.get("tool_calls") or []
        if message["content"] or not calls:
            text = message["content"] or ""
            items.append(_Item("message", _new_id("msg"), 0, text))
            if logprobs:
                tokens = TextLogprobs()
                tokens.add(logprobs)
                tokens.take(message.get("reasoning_content") or "")  # passed over
                items[-1].logprobs = tokens.take(text)
        items.extend(_Item("function_call", _new_id("fc"), 0, c["function"]["arguments"],
                           c["id"], c["function"]["name"]) for c in calls)
        return [item.body(status) for item in items]


@dataclass
class ResponseEvents:
    """The event stream of one response, fed the deltas of ``ChatText.delta``."""

    shape: ResponseShape
    _seq: int = 0
    _items: list[_Item] = field(default_factory=list)
    _open: dict[str, _Item] = field(default_factory=dict)
    """The message and the reasoning item, once opened."""
    _calls: list[_Item] = field(default_factory=list)
    """Function call items, by the chat delta's call index."""

    def _event(self, kind: str, **fields: Any) -> str:
        fields = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {render_json(fields).decode()}\n\n"

    def _where(self, item: _Item) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": item.index}

    def start(self) -> list[str]:
        response = self.shape.response("in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def delta(self, delta: dict[str, Any],
              logprobs: list[dict[str, Any]] | None = None) -> list[str]:
        """The events of one chat delta: reasoning, content (with ``logprobs``, the entries
        of its tokens, when the request includes them), then tool-call pieces."""
        events: list[str] = []
        for key, kind in (("reasoning_content", "reasoning"), ("content", "message")):
            if delta.get(key):
                events += self._text(kind, delta[key], logprobs or [])
        for call in delta.get("tool_calls", ()):
            if "id" in call:  # a call opens with its id and name, before any argument
                item = self._add("function_call", _new_id("fc"), call["id"],
                                 call["function"]["name"])
                self._calls.append(item)
                events.append(self._event("response.output_item.added", output_index=item.index,
                                          item=item.body("in_progress")))
            piece = call["function"].get("arguments", "")
            if piece:
                item = self._calls[call["index"]]
                item.text += piece
                events.append(self._event("response.function_call_arguments.delta",
                                          **self._where(item), delta=piece))
        return events

    def _add(self, kind: str, item_id: str, call_id: str = "", name: str = "") -> _Item:
        item = _Item(kind, item_id, len(self._items), call_id=call_id, name=name)
        self._items.append(item)
        return item

    def _text(self, kind: str, piece: str, logprobs: list[dict[str, Any]]) -> list[str]:
        events: list[str] = []
        item = self._open.get(kind)
        if item is None:
            events += self._open_text(kind)
            item = self._open[kind]
        item.text += piece
        name = "response.reasoning_text.delta" if kind == "reasoning" else \
            "response.output_text.delta"
        extra = {}
        if kind == "message":
            item.logprobs += logprobs
            extra = {"logprobs": _event_entries(logprobs)}
        events.append(self._event(name, **self._where(item), content_index=0, delta=piece,
                                  **extra))
        return events

    def _open_text(self, kind: str) -> list[str]:
        item = self._add(kind, _new_id("rs" if kind == "reasoning" else "msg"))
        self._open[kind] = item
        return [self._event("response.output_item.added", output_index=item.index,
                            item=item.body("in_progress")),
                self._event("response.content_part.added", **self._where(item),
                            content_index=0, part=item.part(""))]

    def finish(self, usage: dict[str, Any], incomplete: bool) -> list[str]:
        """Close every item (an answer with neither text nor calls gets an empty message, as
        a whole response does), then the response itself."""
        events: list[str] = []
        if not self._calls and "message" not in self._open:
            events += self._open_text("message")
        status = "incomplete" if incomplete else "completed"
        for item in self._items:
            where = self._where(item)
            if item.kind == "function_call":
                events.append(self._event("response.function_call_arguments.done", **where,
                                          arguments=item.text))
            else:
                name = "response.reasoning_text.done" if item.kind == "reasoning" else \
                    "response.output_text.done"
                extra = ({} if item.kind == "reasoning"
                         else {"logprobs": _event_entries(item.logprobs)})
                events.append(self._event(name, **where, content_index=0, text=item.text,
                                          **extra))
                events.append(self._event("response.content_part.done", **where,
                                          content_index=0, part=item.part()))
            events.append(self._event("response.output_item.done", output_index=item.index,
                                      item=item.body(status)))
        response = self.shape.response(status, [i.body(status) for i in self._items], usage)
        kind = "response.incomplete" if incomplete else "response.completed"
        events.append(self._event(kind, response=response))
        return events

    def fail(self, exc: APIError) -> list[str]:
        """The stream's end when the run failed: OpenAI's ``error`` event, then the response
        as failed."""
        # Only a failed run ends a stream that started: the engine's failure (500) or its
        # absence (503), both a server error among the codes a response's error may have.
        error = {"code": "server_error", "message": exc.message}
        output = [i.body("incomplete") for i in self._items]
        return [self._event("error", code=exc.code, message=exc.message, param=exc.param),
                self._event("response.failed",
                            response=self.shape.response("failed", output, error=error))]
