"""Turning an API call into an engine run: validate the body, build the prompts and the
``SamplingParams`` (raising ``APIError`` with the offending parameter named), start the run,
and hand back the ``Endpoint`` that answers it."""

from __future__ import annotations

import contextlib
import uuid
from functools import partial
from typing import Any

from pagedserve.controller.client import EngineClient
from pagedserve.controller.errors import InvalidGrammarError
from pagedserve.messages import SamplingParams, SamplingParamsError, StructuredOutputsParams
from pagedserve.serving.chat import ChatError
from pagedserve.serving.chat import render_chat as render_conversation
from pagedserve.serving.openai.api_errors import APIError, engine_unavailable, submit_error
from pagedserve.serving.openai.constraints import constraint_of
from pagedserve.serving.openai.endpoint import Endpoint
from pagedserve.serving.openai.engine_run import EngineRun, Prompt, ServerContext
from pagedserve.serving.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from pagedserve.serving.openai.request_checks import (
    check_logprob_entries,
    check_prompt_chars,
    check_stops,
)
from pagedserve.serving.openai.tools import plan_tools
from pagedserve.serving.reasoning_parsers import REASONING_PARSERS

__all__ = [
    "add_generation_prompt", "check_model_name", "conversation_chars", "prepare_chat",
    "prepare_completion", "render_chat", "warm_chat_template",
]

# Request fields passed to SamplingParams unchanged when present.
_PASSTHROUGH = (
    "temperature", "top_p", "top_k", "min_p", "min_tokens", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens", "seed",
)


def check_model_name(client: EngineClient, model: str | None) -> None:
    """404 for a model this server does not serve (None names the one it serves)."""
    if model is not None and model != client.model_name:
        raise APIError(
            404, f"the model `{model}` does not exist; this server serves `{client.model_name}`",
            param="model", code="model_not_found",
        )


def _check_model(client: EngineClient, model: str | None) -> None:
    check_model_name(client, model)
    if not client.is_healthy():
        raise engine_unavailable()


def _unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{what} is not supported by this server", param=param,
                    code="unsupported_field")


def _sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    names: dict[str, str],
    *,
    echo: bool = False,
    constraint: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """``echo`` (completions): the prompt's logprobs go with the completion's, and
    ``max_tokens`` 0 asks for the prompt alone (scoring it). ``constraint``: the one
    ``tool_choice`` sets, which no other structured-output field may join."""
    if max_tokens == 0 and not echo:
        param = names.get("max_tokens", "max_tokens")
        raise APIError(
            400, f"{param} must be at least 1 (0, the prompt alone, needs echo on "
            "/v1/completions)", param=param,
        )
    asked, field_name = constraint_of(body)
    if constraint is not None and asked is not None:
        raise APIError(400, f"{field_name} cannot be combined with tool_choice required or a "
                       "named function (it sets the output's shape itself)", param=field_name)
    kw: dict[str, Any] = {
        "n": body.n, "max_tokens": max_tokens, "logprobs": logprobs,
        "structured_outputs": constraint or asked, "logit_bias": _logit_bias(body.logit_bias),
        "allowed_token_ids": body.allowed_token_ids,
        "include_stop_str_in_output": body.include_stop_str_in_output,
    }
    if body.prompt_logprobs is not None:
        if body.stream:
            raise APIError(400, "prompt_logprobs cannot be streamed: ask without stream",
                           param="prompt_logprobs")
        kw["prompt_logprobs"] = body.prompt_logprobs
    if echo and logprobs is not None:
        kw["prompt_logprobs"] = max(logprobs, kw.get("prompt_logprobs") or 0)
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


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys, so strings) by token id."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise APIError(400, f"logit_bias key {key[:40]!r} is not a token id",
                           param="logit_bias")
        out[int(key)] = value
    return out


def _check_request_fields(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Fields taken by the schema whose values this server cannot honour."""
    if isinstance(body, CompletionRequest) and body.suffix:
        raise _unsupported("suffix", "suffix (fill in the middle)")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true",
                       param="stream_options")
    if body.best_of is not None and body.best_of != body.n:
        raise _unsupported("best_of", "best_of other than n")


def _truncated(prompts: list[Prompt], keep: int | None) -> list[Prompt]:
    """``truncate_prompt_tokens``: each prompt's last ``keep`` tokens (its text no longer
    matches them, so it goes)."""
    if keep is None:
        return prompts
    return [p if len(p.token_ids) <= keep else Prompt(None, p.token_ids[-keep:])
            for p in prompts]


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
    body: CompletionRequest | ChatCompletionRequest,
) -> tuple[str, EngineRun]:
    request_id = f"{prefix}-{body.request_id or uuid.uuid4().hex}"
    return request_id, EngineRun(ctx, request_id, prompts, params, body.cache_salt,
                                 body.priority)


async def _start(run: EngineRun, prompt_param: str,
                 body: CompletionRequest | ChatCompletionRequest) -> None:
    try:
        await run.start()
    except APIError:
        raise
    except InvalidGrammarError as exc:
        raise APIError(400, str(exc), param=constraint_of(body)[1] or "tools",
                       code=type(exc).__name__) from exc
    except Exception as exc:
        raise submit_error(exc, prompt_param) from exc


async def prepare_completion(ctx: ServerContext, body: CompletionRequest) -> Endpoint:
    client = ctx.client
    _check_model(client, body.model)
    _check_request_fields(body)
    check_stops(ctx.limits, body.stop)
    params = _sampling_params(body, body.max_tokens, body.logprobs, {}, echo=body.echo)
    texts = _prompt_texts(body.prompt)
    check_prompt_chars(ctx.limits, client.max_model_len, map(len, texts or ()), "prompt")
    # Tokenizing a long prompt takes seconds: never on the event loop.
    prompts = await ctx.pool.run(_completion_prompts, client, body.prompt, texts,
                                 body.add_special_tokens)
    prompts = _truncated(prompts, body.truncate_prompt_tokens)
    _check_context(client, prompts, body.max_tokens, "prompt", "max_tokens")
    check_logprob_entries(
        ctx.limits, prompt_lens=[len(p.token_ids) for p in prompts], n=body.n,
        max_tokens=body.max_tokens, top_n=body.logprobs, echo=body.echo,
        max_model_len=client.max_model_len, prompt_top_n=body.prompt_logprobs,
    )
    request_id, run = _new_run(ctx, "cmpl", prompts, params, body)
    await _start(run, "prompt", body)
    return Endpoint(
        chat=False, client=client, run=run, request_id=request_id, model=client.model_name,
        stream=body.stream, include_usage=_include_usage(body), top_n=body.logprobs,
        echo=body.echo, pool=ctx.pool, prompt_top_n=body.prompt_logprobs,
        token_ids_as_text=bool(body.return_tokens_as_token_ids),
        return_token_ids=bool(body.return_token_ids),
    )


def _prompt_texts(prompt: Any) -> list[str] | None:
    """The prompt's texts, one per prompt of a batch; None for token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return None


def _completion_prompts(
    client: EngineClient, prompt: Any, texts: list[str] | None, add_special_tokens: bool,
) -> list[Prompt]:
    if texts is not None:
        if client.tokenizer is None:
            raise APIError(400, "text prompts need a tokenizer; send token ids", param="prompt")
        return [Prompt(t, client.tokenizer.encode(t, add_special_tokens)) for t in texts]
    if prompt and all(isinstance(p, list) for p in prompt):
        return [Prompt(None, list(p)) for p in prompt]
    return [Prompt(None, list(prompt))]


async def prepare_chat(ctx: ServerContext, body: ChatCompletionRequest) -> Endpoint:
    client = ctx.client
    _check_model(client, body.model)
    _check_request_fields(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    top_n = (body.top_logprobs or 0) if body.logprobs else None
    names = {"logprobs": "top_logprobs", "max_tokens": max_param}
    check_stops(ctx.limits, body.stop)
    tools = plan_tools(body, ctx.tool_call_parser,
                       client.tokenizer.chat_template if client.tokenizer else None)
    params = _sampling_params(body, max_tokens, top_n, names, constraint=tools.constraint)
    check_prompt_chars(ctx.limits, client.max_model_len, [conversation_chars(body.messages)],
                       "messages")
    # The template (Jinja) and the tokenizer run off the event loop.
    prompt = await ctx.pool.run(partial(
        render_chat, client, body.messages, add_generation_prompt(body),
        allow_special_tokens=ctx.allow_special_tokens_in_content,
        continue_final_message=body.continue_final_message, documents=body.documents,
        chat_template_kwargs=body.chat_template_kwargs,
        add_special_tokens=body.add_special_tokens, tools=tools.tools,
    ))
    prompt = _truncated([prompt], body.truncate_prompt_tokens)[0]
    _check_context(client, [prompt], max_tokens, "messages", max_param)
    check_logprob_entries(
        ctx.limits, prompt_lens=[len(prompt.token_ids)], n=body.n, max_tokens=max_tokens,
        top_n=top_n, echo=False, max_model_len=client.max_model_len,
        prompt_top_n=body.prompt_logprobs,
    )
    request_id, run = _new_run(ctx, "chatcmpl", [prompt], params, body)
    # A constrained tool call is the whole answer: no reasoning comes before it.
    reasoning = None
    if ctx.reasoning_parser is not None and tools.constraint is None:
        reasoning = REASONING_PARSERS[ctx.reasoning_parser]
    await _start(run, "messages", body)
    return Endpoint(
        chat=True, client=client, run=run, request_id=request_id, model=client.model_name,
        stream=body.stream, include_usage=_include_usage(body), top_n=top_n, pool=ctx.pool,
        prompt_top_n=body.prompt_logprobs,
        token_ids_as_text=bool(body.return_tokens_as_token_ids),
        return_token_ids=bool(body.return_token_ids), tool_calls=tools.fmt,
        reasoning=reasoning, show_reasoning=body.include_reasoning,
    )


def add_generation_prompt(body: ChatCompletionRequest | Any) -> bool:
    """A chat body's (or ``/tokenize``'s) ``add_generation_prompt``, by vLLM's rule: continuing
    the final message turns it off unless the request set it."""
    if body.continue_final_message and "add_generation_prompt" not in body.model_fields_set:
        return False
    return body.add_generation_prompt


def conversation_chars(chat: list[ChatMessage]) -> int:
    """A conversation's size in characters, before the template adds its own."""
    return sum(len(m.role) + len(m.text()) + len(m.name or "") for m in chat)


def render_chat(
    client: EngineClient, chat: list[ChatMessage], add_prompt: bool = True, *,
    allow_special_tokens: bool = False, continue_final_message: bool = False,
    documents: list[dict[str, str]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None, add_special_tokens: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> Prompt:
    """A conversation through the chat template (``add_prompt``: open the assistant's turn),
    as ``serving.chat.render_chat`` renders it for every caller (control-token text in the
    messages stays text unless ``allow_special_tokens``; unknown roles refused);
    ``add_special_tokens`` adds the tokenizer's BOS and such on top of the template's."""
    tok = client.tokenizer
    if tok is None:
        raise APIError(400, "chat needs a tokenizer with a chat template", param="messages")
    # Turned into template input by ``serving.chat.template_message``, as ``LLM.chat``'s are.
    msgs = [m.model_dump(exclude_none=True) for m in chat]
    try:
        text, ids = render_conversation(
            tok, msgs, add_generation_prompt=add_prompt,
            allow_special_tokens=allow_special_tokens,
            continue_final_message=continue_final_message, documents=documents,
            chat_template_kwargs=chat_template_kwargs, tools=tools,
        )
    except ChatError as exc:
        param = "chat_template_kwargs" if str(exc).startswith("chat_template_kwargs") else (
            "continue_final_message" if str(exc).startswith("continue_final_message")
            else "messages")
        raise APIError(400, str(exc), param=param) from exc
    return Prompt(text, tok.with_special_tokens(ids) if add_special_tokens else ids)


def warm_chat_template(client: EngineClient) -> None:
    """Render one conversation now, at start-up: the first render compiles the template
    (tens of ms for a real model's), which would otherwise land on the first chat request."""
    if client.tokenizer is not None and client.tokenizer.chat_template:
        with contextlib.suppress(APIError):  # a template that rejects it fails per request
            render_chat(client, [ChatMessage(role="user", content="Hello")])


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)
