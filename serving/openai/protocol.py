"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests validate types, every numeric field's range (the bounds are ``SamplingParams``'
table, ``sampling_params.RANGES``, so the server, the batch API and ``LLM.generate`` agree on
what is valid) and that every text is valid Unicode (a lone surrogate cannot be encoded, so it
would fail deep in the tokenizer or the response). Unknown request fields are ignored, as the
OpenAI clients send fields this server has no use for. Extensions beyond the OpenAI schema:
``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``, ``cache_salt`` (a tenant's private prefix cache),
and vLLM's ``structured_outputs`` with its older ``guided_json``, ``guided_regex``,
``guided_choice`` and ``guided_grammar``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from pagedserve.sampling_params import RANGES, TOKEN_ID, Range

__all__ = [
    "APIRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ErrorBody",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "StreamOptions",
    "UsageInfo",
]


def _bounded(kind: type, allowed: Range) -> Any:
    """``kind`` constrained to ``allowed`` (the bounds land in the OpenAPI schema too)."""
    low = {"gt": allowed.lo} if allowed.lo_open else {"ge": allowed.lo}
    return Annotated[kind, Field(le=allowed.hi, **low)]


# The request models' numeric types, by the SamplingParams field each one feeds.
TokenId = _bounded(StrictInt, TOKEN_ID)
# A prompt's ids are bounded above only: one below 0 or past the vocabulary is the engine's
# InvalidTokenError (it knows the vocabulary), a 400 with that code.
PromptTokenId = Annotated[StrictInt, Field(le=TOKEN_ID.hi)]
Count = _bounded(int, RANGES["max_tokens"])
N = _bounded(int, RANGES["n"])
TopLogprobs = _bounded(int, RANGES["logprobs"])
Seed = _bounded(int, RANGES["seed"])
TopK = _bounded(int, RANGES["top_k"])
Temperature = _bounded(float, RANGES["temperature"])
TopP = _bounded(float, RANGES["top_p"])
MinP = _bounded(float, RANGES["min_p"])
Penalty = _bounded(float, RANGES["presence_penalty"])  # presence and frequency alike
RepetitionPenalty = _bounded(float, RANGES["repetition_penalty"])
LogitBias = Annotated[float, Field(ge=-100.0, le=100.0)]  # OpenAI's bounds


def _check_text(value: Any) -> None:
    """Raise ValueError on a string (also inside lists and dicts) that is not valid Unicode."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"must be valid Unicode text: a lone surrogate at character {exc.start}"
                ) from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_text(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key)
            _check_text(item)


class APIRequest(BaseModel):
    """Base of every request body: unknown fields ignored, every text valid Unicode."""

    model_config = ConfigDict(extra="ignore")

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        _check_text(value)
        return value


class StreamOptions(APIRequest):
    include_usage: bool = False


class JSONSchemaFormat(APIRequest):
    name: str = "response"
    description: str | None = None
    # "schema" is a BaseModel attribute name, so the field is aliased.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(APIRequest):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(APIRequest):
    """vLLM's ``structured_outputs`` extension: exactly one constraint."""

    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class _SamplingFields(APIRequest):
    """Fields shared by both endpoints that map one to one onto ``SamplingParams``."""

    model: str | None = None
    n: N = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, LogitBias] | None = None  # refused when not empty, bounded all the same
    # extensions
    top_k: TopK | None = None
    min_p: MinP | None = None
    min_tokens: Count | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool | None = None
    cache_salt: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older spellings of structured_outputs' fields
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt`` is text, token ids, or a batch of either."""

    prompt: StrictStr | list[PromptTokenId] | list[StrictStr] | list[list[PromptTokenId]]
    max_tokens: Count | None = 16
    logprobs: TopLogprobs | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: N | None = None


class TextPart(APIRequest):
    type: Literal["text"]
    text: str


class ChatMessage(APIRequest):
    role: str
    content: StrictStr | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over the older
    ``max_tokens``; with neither, generation may run to the end of the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[dict[str, Any]] | None = None


# ------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache (not computed again)."""
    cached_tokens_host: int = 0
    """Of those, the tokens found in the host KV tier and copied back (a pagedserve field)."""


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": what}
    for status, what in ((400, "invalid request"), (401, "missing or invalid API key"),
                         (404, "unknown model or route"), (500, "internal error"),
                         (503, "the engine is down or full"))
}
"""Every error status a route may answer, with OpenAI's error body, for the OpenAPI schema."""
