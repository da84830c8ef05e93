"""``/v1/completions`` and ``/v1/chat/completions``: request -> engine run -> response.

Both endpoints share one path: ``prepare`` turns the body into an ``EngineRun`` and an
``Endpoint``; the ``Endpoint`` here either waits and builds one response or streams
server-sent events. A stream forwards the engine's deltas (text
is append-only: the engine itself holds back what a stop string could still cut), coalescing
those that arrived while the client was reading into one event.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.controller.client import EngineClient
from pagedserve.messages import (
    CompletionDelta,
    CompletionOutput,
)
from pagedserve.serving.openai.api_errors import APIError
from pagedserve.serving.openai.cpu_pool import CpuPool
from pagedserve.serving.openai.engine_run import EngineRun
from pagedserve.serving.openai.render import render_json
from pagedserve.serving.openai.token_entries import token_text, top_entries
from pagedserve.serving.openai.tools import ChatText
from pagedserve.serving.reasoning_parsers import ReasoningFormat
from pagedserve.serving.tool_parsers import ToolCallFormat

__all__ = ["Endpoint"]

# A stream chunk costing more than this many token entries (each a detokenized token, with
# its alternatives) is built off the event loop; below it the thread hop costs more than the
# work (about 5 us an entry).
_OFF_LOOP_ENTRIES = 1024

@dataclass
class Endpoint:
    """Everything the response code needs to know about one prepared call."""

    chat: bool
    client: EngineClient
    run: EngineRun
    request_id: str
    model: str
    stream: bool
    include_usage: bool
    top_n: int | None
    """Top alternatives per token when logprobs were asked for, else None."""
    echo: bool = False
    pool: CpuPool | None = None
    prompt_top_n: int | None = None
    """``prompt_logprobs`` asked for: top alternatives per prompt token, else None."""
    token_ids_as_text: bool = False
    """``return_tokens_as_token_ids``: logprob entries name tokens ``token_id:<id>``."""
    return_token_ids: bool = False
    """The prompt's and each choice's token ids go in the answer (vLLM's
    ``return_token_ids``)."""
    tool_calls: ToolCallFormat | None = None
    """How a chat answer's tool calls are read from its text (None: it is all content)."""
    reasoning: ReasoningFormat | None = None
    """How a chat answer's reasoning is split off (None: it has none)."""
    show_reasoning: bool = True
    created: int = field(default_factory=lambda: int(time.time()))

    # ------------------------------------------------------------------- non-streaming
    async def respond(self, is_disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any]:
        """Wait for the whole answer and build it (off the event loop, with a pool)."""
        await self.run.wait(is_disconnected)
        if self.pool is None:
            return self._response()
        return await self.pool.run(self._response)

    def _response(self) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for i, sub in enumerate(self.run.subs):
            assert sub.latest is not None
            prefix = self._echo_text(i) if self.echo else ""
            prompt = self._echo_logprobs(i)
            for comp in sub.latest.outputs:
                choice = self._choice(i, comp, prefix + comp.text, comp.logprobs or [], prompt)
                if self.prompt_top_n is not None and not self.chat:
                    choice["prompt_logprobs"] = self._prompt_logprobs(i)
                if self.return_token_ids:
                    if not self.chat:
                        choice["prompt_token_ids"] = list(sub.prompt.token_ids)
                    choice["token_ids"] = list(comp.token_ids)
                choices.append(choice)
        response = {
            "id": self.request_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(),
        }
        if self.chat:  # vLLM's place for these on chat: one prompt, the answer's top level
            if self.prompt_top_n is not None:
                response["prompt_logprobs"] = self._prompt_logprobs(0)
            if self.return_token_ids:
                response["prompt_token_ids"] = list(self.run.subs[0].prompt.token_ids)
        return response

    def _prompt_logprobs(self, sub_index: int) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token, null for the first, else ``{token id:
        {logprob, rank, decoded_token}}`` for the token and its top alternatives. A rank is
        the place among those alternatives (1 = most likely); the prompt token's own is null
        when it is not among them."""
        num = self.prompt_top_n or 0
        sub = self.run.subs[sub_index]
        lps = sub.acc.output.prompt_logprobs or []
        out: list[dict[str, dict[str, Any]] | None] = []
        for entry in lps:
            if entry is None:
                out.append(None)
                continue
            token, lp, top = top_entries(entry, num)
            ranks = {t: r for r, (t, _) in enumerate(top, 1)}
            shown: dict[str, dict[str, Any]] = {
                str(token): {"logprob": lp, "rank": ranks.get(token),
                             "decoded_token": self._text(token)}}
            for t, v in top:
                shown.setdefault(str(t), {"logprob": v, "rank": ranks[t],
                                          "decoded_token": self._text(t)})
            out.append(shown)
        return out

    def chat_logprobs(self, entries: list[dict[int, float]]) -> list[dict[str, Any]]:
        """A chat answer's ``logprobs.content`` for the engine's ``entries`` (the shape the
        Responses API gives an ``output_text`` too)."""
        return self._logprobs(entries, 0)["content"]

    def _text(self, token_id: int) -> str:
        if self.token_ids_as_text:
            return f"token_id:{token_id}"
        return token_text(self.client, token_id)

    def _choice(
        self,
        sub_index: int,
        comp: CompletionOutput,
        text: str,
        logprobs: list[dict[int, float]],
        prompt: list[tuple[int, dict[int, float] | None]],
    ) -> dict[str, Any]:
        n = self.run.params.n
        choice: dict[str, Any] = {"index": sub_index * n + comp.index}
        finish_reason = comp.finish_reason
        if self.chat:
            choice["message"], finish_reason = self._chat_text().message(
                text, finish_reason)
        else:
            choice["text"] = text
        choice["logprobs"] = (
            self._logprobs(logprobs, 0, prompt) if self.top_n is not None else None
        )
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = comp.stop_reason
        return choice

    def _chat_text(self) -> ChatText:
        return ChatText(self.tool_calls, self.reasoning, self.show_reasoning)

    def _usage(self) -> dict[str, Any]:
        prompt = sum(len(s.prompt.token_ids) for s in self.run.subs)
        completion = sum(
            len(c.token_ids) for s in self.run.subs if s.latest for c in s.latest.outputs
        )
        cached = sum(s.latest.num_cached_tokens for s in self.run.subs if s.latest)
        host = sum(s.latest.num_host_cached_tokens for s in self.run.subs if s.latest)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            # Prefix-cache hits, all prompts; of them, those served from the host KV tier.
            "prompt_tokens_details": {"cached_tokens": cached, "cached_tokens_host": host},
        }

    def _echo_text(self, sub_index: int) -> str:
        """The prompt as echoed: its text, or its token ids decoded."""
        prompt = self.run.subs[sub_index].prompt
        if prompt.text is not None:
            return prompt.text
        tok = self.client.tokenizer
        return tok.decode(prompt.token_ids, skip_special_tokens=False) if tok is not None else ""

    def _echo_logprobs(self, sub_index: int) -> list[tuple[int, dict[int, float] | None]]:
        """(token id, its entry) per prompt token when echo asks for logprobs (the first
        token's entry is None), else nothing."""
        if not self.echo or self.top_n is None:
            return []
        sub = self.run.subs[sub_index]
        lps = sub.acc.output.prompt_logprobs or []
        return [(t, lps[p] if p < len(lps) else None) for p, t in enumerate(sub.prompt.token_ids)]

    def _logprobs(
        self,
        entries: list[dict[int, float]],
        text_offset: int,
        prompt: Sequence[tuple[int, dict[int, float] | None]] = (),
    ) -> dict[str, Any]:
        """The choice's ``logprobs``; a completion's ``prompt`` tokens (echo) come first, with
        null where a position has no logprob (the first)."""
        num = self.top_n or 0
        if self.chat:
            content = []
            for entry in entries:
                tid, lp, top = top_entries(entry, num)
                s = self._text(tid)
                content.append({
                    "token": s, "logprob": lp, "bytes": list(s.encode()),
                    "top_logprobs": [
                        {"token": (ts := self._text(t)), "logprob": v,
                         "bytes": list(ts.encode())}
                        for t, v in top
                    ],
                })
            return {"content": content}
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        items = [*prompt, *((next(iter(e)), e) for e in entries)]
        for token_id, item in items:
            s = self._text(token_id)
            if item is None:
                token_logprobs.append(None)
                tops.append(None)
            else:
                _, lp, top = top_entries(item, num)
                token_logprobs.append(lp)
                tops.append({self._text(t): v for t, v in top})
            tokens.append(s)
            offsets.append(text_offset)
            text_offset += len(s)
        return {
            "tokens": tokens, "token_logprobs": token_logprobs,
            "top_logprobs": tops, "text_offset": offsets,
        }

    # ----------------------------------------------------------------------- streaming
    async def stream_events(self) -> AsyncIterator[str]:
        n = self.run.params.n
        states = [[_Sent(self._chat_text()) for _ in range(n)] for _ in self.run.subs]
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        try:
            if self.chat:  # the role comes first, before any content
                first = [
                    {"index": i * n + j, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}
                    for i in range(len(self.run.subs)) for j in range(n)
                ]
                prompt_ids = (list(self.run.subs[0].prompt.token_ids)
                              if self.return_token_ids else None)
                yield self._event(obj, first, prompt_token_ids=prompt_ids)
            async for _ in self.run.updates():
                merged = [self._merged(i) for i in range(len(self.run.subs))]
                if self.pool is not None and self._entries(merged, states) > _OFF_LOOP_ENTRIES:
                    event = await self.pool.run(self._chunk, obj, merged, states)
                else:
                    event = self._chunk(obj, merged, states)
                if event is not None:
                    yield event
        except APIError as exc:
            yield _sse(exc.body())
            yield "data: [DONE]\n\n"
            return
        if self.include_usage:
            yield self._event(obj, [], usage=self._usage())
        yield "data: [DONE]\n\n"

    def _merged(self, sub_index: int) -> list[CompletionDelta]:
        """The deltas of a request that arrived since the last event, one per completion."""
        merged: dict[int, CompletionDelta] = {}
        for delta in self.run.take_pending(sub_index):
            for d in delta.completions:
                _merge(merged, d)
        return list(merged.values())

    def _entries(self, merged: list[list[CompletionDelta]], states: list[list[_Sent]]) -> int:
        """What the next event costs to build, in token entries: the new tokens, and the
        prompt of a first echo chunk, each with its alternatives when logprobs are asked."""
        per_token = 1 + (self.top_n or 0) if self.top_n is not None else 0
        total = 0
        for i, deltas in enumerate(merged):
            for d in deltas:
                total += len(d.token_ids) * per_token
                if self.echo and not states[i][d.index].started:
                    total += len(self.run.subs[i].prompt.token_ids) * max(1, per_token)
        return total

    def _chunk(
        self, obj: str, merged: list[list[CompletionDelta]], states: list[list[_Sent]]
    ) -> str | None:
        choices = []
        for i, deltas in enumerate(merged):
            for d in deltas:
                choice = self._delta(i, d, states[i][d.index])
                if choice is not None:
                    choices.append(choice)
        return self._event(obj, choices) if choices else None

    def _delta(self, sub_index: int, d: CompletionDelta, sent: _Sent) -> dict[str, Any] | None:
        if sent.finished:
            return None
        finished = d.finish_reason is not None
        text = d.text
        prompt: list[tuple[int, dict[int, float] | None]] = []
        if not sent.started and self.echo:
            # The first chunk of a completion: the prompt, and with logprobs the prompt's
            # (complete by now: the first token is sampled after the whole prompt).
            text = self._echo_text(sub_index) + text
            prompt = self._echo_logprobs(sub_index)
        first = not sent.started
        sent.started = True
        entries = d.logprobs or []
        ids = d.token_ids if self.return_token_ids else []
        finish_reason = d.finish_reason
        delta: dict[str, Any] = {}
        if self.chat:  # the text as content and tool calls (some held back until it is clear)
            delta, finish_reason = sent.chat.delta(text, finish_reason)
        if not (delta if self.chat else text) and not entries and not prompt and not finished \
                and not ids:
            return None
        sent.finished = finished
        choice: dict[str, Any] = {"index": sub_index * self.run.params.n + d.index}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = text
        logprobs = None
        if self.top_n is not None:
            logprobs = self._logprobs(entries, sent.offset, prompt)
            sent.offset += sum(len(t) for t in logprobs.get("tokens", []))
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = d.stop_reason
        if self.return_token_ids:
            if first and not self.chat:
                choice["prompt_token_ids"] = list(self.run.subs[sub_index].prompt.token_ids)
            choice["token_ids"] = list(ids)
        return choice

    def _event(
        self, obj: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> str:
        chunk: dict[str, Any] = {
            "id": self.request_id, "object": obj, "created": self.created,
            "model": self.model, "choices": choices,
        }
        if prompt_token_ids is not None:
            chunk["prompt_token_ids"] = prompt_token_ids
        if self.include_usage:
            chunk["usage"] = usage
        return _sse(chunk)


def _merge(merged: dict[int, CompletionDelta], d: CompletionDelta) -> None:
    """Coalesce consecutive deltas of one completion."""
    prev = merged.get(d.index)
    if prev is None:
        merged[d.index] = CompletionDelta(
            d.index, list(d.token_ids), d.text, list(d.logprobs) if d.logprobs else None,
            d.finish_reason, d.stop_reason, d.cumulative_logprob,
        )
        return
    prev.token_ids.extend(d.token_ids)
    prev.text += d.text
    if d.logprobs:
        prev.logprobs = (prev.logprobs or []) + d.logprobs
    prev.finish_reason, prev.stop_reason = d.finish_reason, d.stop_reason
    prev.cumulative_logprob = d.cumulative_logprob


@dataclass(slots=True)
class _Sent:
    chat: ChatText
    offset: int = 0
    started: bool = False
    finished: bool = False


def _sse(obj: Any) -> str:
    # NaN passes as it always did in a stream (JSON has no NaN; a client parser may take it).
    return f"data: {render_json(obj, allow_nan=True).decode()}\n\n"


# -------------------------------------------------------------------------- preparation
