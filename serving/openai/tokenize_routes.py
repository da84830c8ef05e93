"""``POST /tokenize`` and ``POST /detokenize``, in the shape vLLM's server answers them.

``/tokenize`` takes ``{"prompt": str, "add_special_tokens"?: bool}`` (the ids
``/v1/completions`` would compute; special tokens are added by default) or ``{"messages": [...]}``
with the chat request's template fields (``add_generation_prompt``, ``continue_final_message``,
``documents``, ``chat_template_kwargs``, ``tools``), rendered through the chat template as
``/v1/chat/completions`` renders it (the template writes its own special tokens, so none are
added by default), with ``"return_token_strs": true`` for the token strings too. It answers
``{"count", "max_model_len", "tokens", "token_strs"}``. ``/detokenize`` takes
``{"tokens": [...]}`` and answers ``{"prompt": str}``; an id outside the vocabulary is a 400.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import StrictStr

from pagedserve.controller.client import EngineClient
from pagedserve.controller.tokenizer import Tokenizer
from pagedserve.serving.openai.api_errors import APIError
from pagedserve.serving.openai.engine_run import ServerContext
from pagedserve.serving.openai.json_turns import JSONInTurns
from pagedserve.serving.openai.prepare import (
    add_generation_prompt,
    check_model_name,
    conversation_chars,
    render_chat,
)
from pagedserve.serving.openai.protocol import (
    ERROR_RESPONSES,
    APIRequest,
    ChatMessage,
    ChatTool,
    TokenId,
)
from pagedserve.serving.openai.render import render_json
from pagedserve.serving.openai.request_checks import check_prompt_chars
from pagedserve.serving.openai.tools import template_tools

__all__ = ["DetokenizeRequest", "TokenizeRequest", "tokenize_router"]


class TokenizeRequest(APIRequest):
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Default: True for a prompt, False for messages (the chat template has them)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(APIRequest):
    model: str | None = None
    tokens: list[TokenId]


def _tokenizer(client: EngineClient, model: str | None) -> Tokenizer:
    check_model_name(client, model)
    if client.tokenizer is None:
        raise APIError(400, "this model has no tokenizer: the server works on token ids only")
    return client.tokenizer


def tokenize(
    client: EngineClient, body: TokenizeRequest, allow_special_tokens: bool = False
) -> dict[str, Any]:
    tok = _tokenizer(client, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = list(tok.hf.encode(body.prompt, add_special_tokens=special))
    else:
        assert body.messages is not None
        if not body.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        ids = render_chat(
            client, body.messages, add_generation_prompt(body),
            allow_special_tokens=allow_special_tokens,
            continue_final_message=body.continue_final_message, documents=body.documents,
            chat_template_kwargs=body.chat_template_kwargs,
            add_special_tokens=bool(body.add_special_tokens),
            tools=template_tools(body.tools) if body.tools else None,
        ).token_ids
    strs = [str(s) for s in tok.hf.convert_ids_to_tokens(ids)] if body.return_token_strs else None
    return {
        "count": len(ids), "max_model_len": client.max_model_len, "tokens": ids,
        "token_strs": strs,
    }


def detokenize(client: EngineClient, body: DetokenizeRequest) -> dict[str, Any]:
    tok = _tokenizer(client, body.model)
    size = tok.vocab_size
    for i, t in enumerate(body.tokens):
        if not 0 <= t < size:
            raise APIError(
                400, f"tokens[{i}] = {t} is out of the vocabulary (0 <= id < {size})",
                param="tokens", code="invalid_token",
            )
    return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}


def tokenize_router(ctx: ServerContext) -> APIRouter:
    """The two routes, over ``ctx.client``'s tokenizer (no engine round trip); messages render
    as ``/v1/chat/completions`` renders them (``allow_special_tokens_in_content`` alike). The
    work and the answer's JSON (a long prompt's ids) are done in ``ctx.pool``, off the event
    loop."""
    router = APIRouter(route_class=JSONInTurns)
    client = ctx.client
    json_answer = {200: {"content": {"application/json": {}}}}

    @router.post("/tokenize", response_class=Response,
                 responses={**json_answer, **ERROR_RESPONSES})
    async def _tokenize(body: TokenizeRequest) -> Response:
        size = len(body.prompt) if body.prompt is not None else (
            conversation_chars(body.messages) if body.messages is not None else 0)
        param = "prompt" if body.prompt is not None else "messages"
        check_prompt_chars(ctx.limits, client.max_model_len, [size], param)
        special = ctx.allow_special_tokens_in_content
        answer = await ctx.pool.run(lambda: render_json(tokenize(client, body, special)))
        return Response(answer, media_type="application/json")

    @router.post("/detokenize", response_class=Response,
                 responses={**json_answer, **ERROR_RESPONSES})
    async def _detokenize(body: DetokenizeRequest) -> Response:
        answer = await ctx.pool.run(lambda: render_json(detokenize(client, body)))
        return Response(answer, media_type="application/json")

    return router
