"""``/v1/completions`` and ``/v1/chat/completions``: request -> engine run -> response.

Both endpoints share one path: turn the body into prompts and ``SamplingParams`` (raising
``APIError`` with the offending parameter named), start an ``EngineRun``, then either wait and
build one response or stream server-sent events. A stream forwards the engine's deltas (text
is append-only: the engine itself holds back what a stop string could still cut), coalescing
those that arrived while the client was reading into one event.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.controller.client import EngineClient
from pagedserve.messages import (
    CompletionDelta,
    CompletionOutput,
    SamplingParams,
    SamplingParamsError,
)
from pagedserve.serving.openai_protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from pagedserve.serving.openai_serving import (
    APIError,
    EngineRun,
    Prompt,
    ServerContext,
    engine_unavailable,
    submit_error,
    token_text,
    top_entries,
)

__all__ = ["Endpoint", "prepare_chat", "prepare_completion", "render_chat"]

# Request fields passed to SamplingParams unchanged when present.
_PASSTHROUGH = (
    "temperature", "top_p", "top_k", "min_p", "min_tokens", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens", "seed",
)


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
    created: int = field(default_factory=lambda: int(time.time()))

    # ------------------------------------------------------------------- non-streaming
    async def respond(self, is_disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any]:
        await self.run.wait(is_disconnected)
        choices: list[dict[str, Any]] = []
        for i, sub in enumerate(self.run.subs):
            assert sub.latest is not None
            prefix = self._echo_text(i) if self.echo else ""
            prompt = self._echo_logprobs(i)
            for comp in sub.latest.outputs:
                choices.append(
                    self._choice(i, comp, prefix + comp.text, comp.logprobs or [], prompt)
                )
        return {
            "id": self.request_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(),
        }

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
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = (
            self._logprobs(logprobs, 0, prompt) if self.top_n is not None else None
        )
        choice["finish_reason"] = comp.finish_reason
        choice["stop_reason"] = comp.stop_reason
        return choice

    def _usage(self) -> dict[str, Any]:
        prompt = sum(len(s.prompt.token_ids) for s in self.run.subs)
        completion = sum(
            len(c.token_ids) for s in self.run.subs if s.latest for c in s.latest.outputs
        )
        cached = sum(s.latest.num_cached_tokens for s in self.run.subs if s.latest)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},  # prefix-cache hits, all prompts
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
                s = token_text(self.client, tid)
                content.append({
                    "token": s, "logprob": lp, "bytes": list(s.encode()),
                    "top_logprobs": [
                        {"token": (ts := token_text(self.client, t)), "logprob": v,
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
            s = token_text(self.client, token_id)
            if item is None:
                token_logprobs.append(None)
                tops.append(None)
            else:
                _, lp, top = top_entries(item, num)
                token_logprobs.append(lp)
                tops.append({token_text(self.client, t): v for t, v in top})
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
        states = [[_Sent() for _ in range(n)] for _ in self.run.subs]
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        try:
            if self.chat:  # the role comes first, before any content
                first = [
                    {"index": i * n + j, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}
                    for i in range(len(self.run.subs)) for j in range(n)
                ]
                yield self._event(obj, first)
            async for _ in self.run.updates():
                choices = []
                for i in range(len(self.run.subs)):
                    merged: dict[int, CompletionDelta] = {}
                    for delta in self.run.take_pending(i):
                        for d in delta.completions:
                            _merge(merged, d)
                    for d in merged.values():
                        choice = self._delta(i, d, states[i][d.index])
                        if choice is not None:
                            choices.append(choice)
                if choices:
                    yield self._event(obj, choices)
        except APIError as exc:
            yield _sse(exc.body())
            yield "data: [DONE]\n\n"
            return
        if self.include_usage:
            yield self._event(obj, [], usage=self._usage())
        yield "data: [DONE]\n\n"

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
        sent.started = True
        entries = d.logprobs or []
        if not text and not entries and not prompt and not finished:
            return None
        sent.finished = finished
        choice: dict[str, Any] = {"index": sub_index * self.run.params.n + d.index}
        if self.chat:
            choice["delta"] = {"content": text} if text or not finished else {}
        else:
            choice["text"] = text
        logprobs = None
        if self.top_n is not None:
            logprobs = self._logprobs(entries, sent.offset, prompt)
            sent.offset += sum(len(t) for t in logprobs.get("tokens", []))
        choice["logprobs"] = logprobs
        choice["finish_reason"] = d.finish_reason
        choice["stop_reason"] = d.stop_reason
        return choice

    def _event(
        self, obj: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None
    ) -> str:
        chunk: dict[str, Any] = {
            "id": self.request_id, "object": obj, "created": self.created,
            "model": self.model, "choices": choices,
        }
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
    offset: int = 0
    started: bool = False
    finished: bool = False


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


# -------------------------------------------------------------------------- preparation


def _check_model(client: EngineClient, model: str | None) -> None:
    if model is not None and model != client.model_name:
        raise APIError(
            404, f"the model `{model}` does not exist; this server serves `{client.model_name}`",
            param="model", code="model_not_found",
        )
    if not client.is_healthy():
        raise engine_unavailable()


def _unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{what} is not supported by this server", param=param)


def _sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    names: dict[str, str],
    *,
    echo: bool = False,
) -> SamplingParams:
    """``echo`` (completions): the prompt's logprobs go with the completion's, and
    ``max_tokens`` 0 asks for the prompt alone (scoring it)."""
    if max_tokens == 0 and not echo:
        param = names.get("max_tokens", "max_tokens")
        raise APIError(
            400, f"{param} must be at least 1 (0, the prompt alone, needs echo on "
            "/v1/completions)", param=param,
        )
    kw: dict[str, Any] = {"n": body.n, "max_tokens": max_tokens, "logprobs": logprobs}
    if echo and logprobs is not None:
        kw["prompt_logprobs"] = logprobs
    for name in _PASSTHROUGH:
        value = getattr(body, name)
        if value is not None:
            kw[name] = value
    if body.stop is not None:
        kw["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    if body.stop_token_ids is not None:
        kw["stop_token_ids"] = list(body.stop_token_ids)
    try:
        return SamplingParams(**kw)
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=names.get(exc.field, exc.field)) from None


def _check_context(
    client: EngineClient, prompts: list[Prompt], max_tokens: int | None, prompt_param: str,
    max_param: str,
) -> None:
    limit = client.max_model_len
    for p in prompts:
        # A prompt alone (max_tokens 0, echo) may fill the context; otherwise leave room.
        if len(p.token_ids) > limit or (len(p.token_ids) == limit and max_tokens != 0):
            raise APIError(
                400, f"this model's maximum context length is {limit} tokens, and the prompt "
                f"has {len(p.token_ids)}: no room is left to generate",
                param=prompt_param, code="context_length_exceeded",
            )
        if max_tokens is not None and len(p.token_ids) + max_tokens > limit:
            raise APIError(
                400, f"this model's maximum context length is {limit} tokens, but "
                f"{len(p.token_ids) + max_tokens} were requested ({len(p.token_ids)} in the "
                f"prompt, {max_tokens} to generate); lower {max_param} or shorten the prompt",
                param=max_param, code="context_length_exceeded",
            )


def _new_run(
    ctx: ServerContext, prefix: str, prompts: list[Prompt], params: SamplingParams,
    cache_salt: str | None,
) -> tuple[str, EngineRun]:
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    return request_id, EngineRun(ctx, request_id, prompts, params, cache_salt)


async def _start(run: EngineRun, prompt_param: str) -> None:
    try:
        await run.start()
    except APIError:
        raise
    except Exception as exc:
        raise submit_error(exc, prompt_param) from exc


async def prepare_completion(ctx: ServerContext, body: CompletionRequest) -> Endpoint:
    client = ctx.client
    _check_model(client, body.model)
    if body.suffix:
        raise _unsupported("suffix", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise _unsupported("best_of", "best_of other than n")
    if body.logit_bias:
        raise _unsupported("logit_bias", "logit_bias")
    prompts = _completion_prompts(client, body.prompt)
    params = _sampling_params(body, body.max_tokens, body.logprobs, {}, echo=body.echo)
    _check_context(client, prompts, body.max_tokens, "prompt", "max_tokens")
    request_id, run = _new_run(ctx, "cmpl", prompts, params, body.cache_salt)
    await _start(run, "prompt")
    return Endpoint(
        chat=False, client=client, run=run, request_id=request_id, model=client.model_name,
        stream=body.stream, include_usage=_include_usage(body), top_n=body.logprobs,
        echo=body.echo,
    )


def _completion_prompts(client: EngineClient, prompt: Any) -> list[Prompt]:
    if isinstance(prompt, str) or (prompt and all(isinstance(p, str) for p in prompt)):
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        if client.tokenizer is None:
            raise APIError(400, "text prompts need a tokenizer; send token ids", param="prompt")
        return [Prompt(t, client.tokenizer.encode(t)) for t in texts]
    if prompt and all(isinstance(p, list) for p in prompt):
        return [Prompt(None, list(p)) for p in prompt]
    return [Prompt(None, list(prompt))]


async def prepare_chat(ctx: ServerContext, body: ChatCompletionRequest) -> Endpoint:
    client = ctx.client
    _check_model(client, body.model)
    if body.tools:
        raise _unsupported("tools", "tool calling")
    if body.logit_bias:
        raise _unsupported("logit_bias", "logit_bias")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    top_n = (body.top_logprobs or 0) if body.logprobs else None
    names = {"logprobs": "top_logprobs", "max_tokens": max_param}
    params = _sampling_params(body, max_tokens, top_n, names)
    prompt = render_chat(client, body.messages)
    _check_context(client, [prompt], max_tokens, "messages", max_param)
    request_id, run = _new_run(ctx, "chatcmpl", [prompt], params, body.cache_salt)
    await _start(run, "messages")
    return Endpoint(
        chat=True, client=client, run=run, request_id=request_id, model=client.model_name,
        stream=body.stream, include_usage=_include_usage(body), top_n=top_n,
    )


def render_chat(client: EngineClient, chat: list[ChatMessage], add_prompt: bool = True) -> Prompt:
    """A conversation through the chat template (``add_prompt``: open the assistant's turn)."""
    tok = client.tokenizer
    if tok is None:
        raise APIError(400, "chat needs a tokenizer with a chat template", param="messages")
    msgs: list[dict[str, Any]] = []
    for m in chat:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        msgs.append(msg)
    try:
        text = tok.hf.apply_chat_template(msgs, add_generation_prompt=add_prompt, tokenize=False)
    except Exception as exc:  # no template, or the template rejected the conversation
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
    # The template already holds the special tokens (BOS and so on).
    ids = list(tok.hf.encode(text, add_special_tokens=False))
    return Prompt(text, ids)


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)
