"""``POST /tokenize`` and ``POST /detokenize``, in the shape vLLM's server answers them.

``/tokenize`` takes ``{"prompt": str, "add_special_tokens"?: bool}`` (the ids
``/v1/completions`` would compute; special tokens are added by default) or ``{"messages": [...],
"add_generation_prompt"?: bool}`` (rendered through the chat template as
``/v1/chat/completions`` renders it; the template writes its own special tokens, so none are
added by default), with ``"return_token_strs": true`` for the token strings too. It answers
``{"count", "max_model_len", "tokens", "token_strs"}``. ``/detokenize`` takes
``{"tokens": [...]}`` and answers ``{"prompt": str}``; an id outside the vocabulary is a 400.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from pagedserve.controller.client import EngineClient
from pagedserve.controller.tokenizer import Tokenizer
from pagedserve.serving.openai.engine_run import APIError
from pagedserve.serving.openai.prepare import check_model_name, render_chat
from pagedserve.serving.openai.protocol import ERROR_RESPONSES, ChatMessage

__all__ = ["DetokenizeRequest", "TokenizeRequest", "tokenize_router"]


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Default: True for a prompt, False for messages (the chat template has them)."""
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt]


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
        rendered = render_chat(client, body.messages, body.add_generation_prompt,
                               allow_special_tokens=allow_special_tokens)
        ids = rendered.token_ids
        if body.add_special_tokens:  # around the ids: encoding the text again would read
            ids = tok.with_special_tokens(ids)  # the messages' control-token text as tokens
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


def tokenize_router(
    client: EngineClient, *, allow_special_tokens_in_content: bool = False
) -> APIRouter:
    """The two routes, over ``client``'s tokenizer (no engine round trip); messages render
    as ``/v1/chat/completions`` renders them (``allow_special_tokens_in_content`` alike)."""
    router = APIRouter()

    @router.post("/tokenize", responses=ERROR_RESPONSES)
    async def _tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return tokenize(client, body, allow_special_tokens_in_content)

    @router.post("/detokenize", responses=ERROR_RESPONSES)
    async def _detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return detokenize(client, body)

    return router
