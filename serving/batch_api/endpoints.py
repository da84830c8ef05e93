"""One batch line's body through the HTTP endpoint's own code: the same validation, the same
answer (``prepare_completion`` / ``prepare_chat`` / ``prepare_responses``, then ``respond``),
the same errors."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from pagedserve.serving.openai.api_errors import APIError, validation_error
from pagedserve.serving.openai.engine_run import ServerContext
from pagedserve.serving.openai.prepare import prepare_chat, prepare_completion
from pagedserve.serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.serving.openai.responses import prepare_responses
from pagedserve.serving.openai.responses_protocol import ResponsesRequest

__all__ = ["ENDPOINTS", "answer_line"]

ENDPOINTS: dict[str, Any] = {
    "/v1/completions": (CompletionRequest, prepare_completion),
    "/v1/chat/completions": (ChatCompletionRequest, prepare_chat),
    # A Responses object as the body; errors name the Responses fields (``input``, ...).
    "/v1/responses": (ResponsesRequest, prepare_responses),
}


async def _never() -> bool:
    return False


async def answer_line(ctx: ServerContext, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """What ``endpoint`` answers to ``body``; raises its ``APIError``."""
    model, prepare = ENDPOINTS[endpoint]
    if body.get("stream"):
        raise APIError(400, "stream is not supported in a batch", param="stream")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    answer = await prepare(ctx, request)
    try:
        result: dict[str, Any] = await answer.respond(_never)
        return result
    finally:
        answer.run.abort()
