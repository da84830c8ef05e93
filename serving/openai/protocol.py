"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests validate types, every numeric field's range (the bounds are ``SamplingParams``'
table, ``sampling_params.RANGES``, so the server, the batch API and ``LLM.generate`` agree on
what is valid) and that every text is valid Unicode (a lone surrogate cannot be encoded, so it
would fail deep in the tokenizer or the response).

No field is silently dropped. An unknown field is a 400 naming it (``extra="forbid"``). The
fields of OpenAI's and vLLM's request schemas that this server does not implement are declared
all the same, accepted at their neutral value only (``_only``), so a request that relies on one
gets a 400 naming it and saying why, and ``/openapi.json`` shows what each one admits. Only
``user``, ``safety_identifier`` and ``prompt_cache_key`` are taken without effect: hints about
the caller, which OpenAI itself does not let change an answer. Extensions beyond the OpenAI
schema, as vLLM spells them: ``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``prompt_logprobs``, ``truncate_prompt_tokens``, ``add_special_tokens``, ``allowed_token_ids``,
``return_tokens_as_token_ids``, ``return_token_ids``, ``request_id``, ``priority``,
``cache_salt`` (a tenant's private prefix cache), the chat template's
``add_generation_prompt``, ``continue_final_message``, ``documents`` and
``chat_template_kwargs``, ``tools`` and ``tool_choice`` (tool calling), and
``structured_outputs`` with its older ``guided_json``,
``guided_regex``, ``guided_choice`` and ``guided_grammar``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    StrictInt,
    StrictStr,
)

from pagedserve.sampling_params import INT32_MAX, LOGIT_BIAS, RANGES, TOKEN_ID, Range
from pagedserve.serving.request_fields import APIRequest, ConstraintFields

__all__ = [
    "APIRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChatTool",
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
LogitBias = _bounded(float, LOGIT_BIAS)
PromptLogprobs = _bounded(int, RANGES["prompt_logprobs"])


def _only(what: str, *neutral: Any) -> Any:
    """A field this server does not implement, accepted at a ``neutral`` value (or null) only:
    any other value is a 400 that names the field and says what is missing (``what``)."""

    def check(value: Any) -> Any:
        if value is not None and not any(value == n and type(value) is type(n) for n in neutral):
            raise ValueError(f"{what} is not supported by this server")
        return value

    shown = " or ".join(repr(n) for n in neutral) if neutral else "null"
    return Annotated[Any, AfterValidator(check),
                     Field(description=f"Not supported: only {shown} is accepted.")]


class StreamOptions(APIRequest):
    include_usage: bool = False
    continuous_usage_stats: _only("usage in every chunk (continuous_usage_stats)", False) = None


class _SamplingFields(ConstraintFields):
    """Fields shared by both endpoints that map one to one onto ``SamplingParams`` (and the
    constraint fields, ``ConstraintFields``)."""

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
    best_of: N | None = None
    """Only equal to ``n`` (no candidates are ranked)."""
    user: str | None = None
    """The end user's id, as OpenAI takes it (for its abuse monitoring): no effect on the
    answer."""
    safety_identifier: str | None = None
    """OpenAI's successor to ``user``: no effect on the answer."""
    prompt_cache_key: str | None = None
    """OpenAI's prompt-cache routing hint: no effect here, as every prompt's prefix is cached
    (``cache_salt`` keeps a tenant's apart)."""
    logit_bias: dict[str, LogitBias] | None = None
    """Token id (as a string) -> a bias added to its logit before sampling."""
    store: _only("stored completions (store)", False) = None
    metadata: _only("stored completions' metadata", {}) = None
    service_tier: _only("service tiers", "auto", "default") = None
    # extensions
    top_k: TopK | None = None
    min_p: MinP | None = None
    min_tokens: Count | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended a choice at the end of its text."""
    prompt_logprobs: PromptLogprobs | None = None
    """Each prompt token's logprob and this many top alternatives, in ``prompt_logprobs``."""
    truncate_prompt_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    """Keep only the prompt's last this many tokens."""
    allowed_token_ids: list[TokenId] | None = None
    """Sample only among these tokens."""
    return_tokens_as_token_ids: bool | None = None
    """Logprob entries name tokens as ``token_id:<id>`` (text that is not valid UTF-8 stays
    identifiable)."""
    return_token_ids: bool | None = None
    """The prompt's and each choice's token ids in the answer (``prompt_token_ids``,
    ``token_ids``), streamed too."""
    request_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    """The id the answer carries (after its ``cmpl-`` or ``chatcmpl-`` prefix)."""
    priority: Annotated[StrictInt, Field(ge=-INT32_MAX - 1, le=INT32_MAX)] = 0
    """Lower is served first, under ``--scheduling-policy priority``; any other than 0 is
    refused under ``fcfs``."""
    cache_salt: str | None = None
    # vLLM's fields this server does not implement
    use_beam_search: _only("beam search", False) = None
    length_penalty: _only("length_penalty (beam search)", 1.0, 1) = None
    spaces_between_special_tokens: _only("spaces_between_special_tokens false", True) = None
    bad_words: _only("bad_words", []) = None
    logits_processors: _only("custom logits processors") = None
    guided_decoding_backend: _only("choosing the grammar backend per request") = None
    guided_whitespace_pattern: _only("guided_whitespace_pattern (see structured_outputs."
                                     "disable_any_whitespace)") = None
    structural_tag: _only("structural tags") = None
    kv_transfer_params: _only("KV transfer (disaggregated serving)") = None
    vllm_xargs: _only("vllm_xargs (custom extensions)") = None
    mm_processor_kwargs: _only("multimodal inputs") = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt`` is text, token ids, or a batch of either."""

    prompt: StrictStr | list[PromptTokenId] | list[StrictStr] | list[list[PromptTokenId]]
    max_tokens: Count | None = 16
    logprobs: TopLogprobs | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens (BOS, ...) around a text prompt."""
    prompt_embeds: _only("prompt embeddings") = None


class TextPart(APIRequest):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class FunctionDefinition(APIRequest):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON Schema (none: any JSON object)."""
    strict: bool | None = Field(default=None, description=(
        "Accepted, true or false alike: under tool_choice required or a named function the "
        "arguments are always constrained to follow `parameters` (as if strict were true); "
        "under auto they are what the model wrote."))


class ChatTool(APIRequest):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(APIRequest):
    name: FunctionName


class NamedToolChoice(APIRequest):
    type: Literal["function"]
    function: ToolChoiceFunction


class FunctionCall(APIRequest):
    name: str
    arguments: str
    """The arguments as a JSON text, as the model wrote them."""


class ToolCall(APIRequest):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(APIRequest):
    role: str
    content: StrictStr | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: _only("an assistant refusal in the history") = None
    function_call: _only("function_call (deprecated; tool calling)") = None
    audio: _only("audio") = None

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
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """``auto`` (the default with tools) reads calls from the text with the server's parser;
    ``required`` and a named function constrain the output to calls of the given tools."""
    parallel_tool_calls: bool | None = None
    """False: at most one call."""
    reasoning_effort: _only("reasoning_effort") = None
    include_reasoning: bool = True
    echo: _only("echo on chat", False) = None
    add_special_tokens: bool = False
    """Add the tokenizer's special tokens (BOS, ...) on top of what the template writes."""
    add_generation_prompt: bool = True
    """Open the assistant's turn after the messages (the template's switch)."""
    continue_final_message: bool = False
    """Leave the last message open for the model to continue (an assistant prefill)."""
    documents: list[dict[str, str]] | None = None
    """Documents for a template that renders them (retrieval-augmented generation)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """More variables for the chat template (``enable_thinking``, ...)."""
    chat_template: _only("a chat template per request") = None
    modalities: _only("output modalities other than text", ["text"]) = None
    prediction: _only("predicted outputs") = None
    web_search_options: _only("web search") = None
    functions: _only("functions (deprecated; tool calling)") = None
    function_call: _only("function_call (deprecated; tool calling)") = None
    audio: _only("audio output") = None
    verbosity: _only("verbosity") = None


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
