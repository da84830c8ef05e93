"""The request body of ``POST /v1/responses`` (OpenAI's Responses API), as pydantic models.

The same rules as ``protocol``'s chat and completion bodies: an unknown field is a 400 naming
it, and a field of OpenAI's schema that this server cannot honour is declared all the same and
accepted at its neutral value only. This server keeps no state, so ``store`` true and
``previous_response_id`` (and ``conversation``, ``background``) are refused by name: the caller
sends the whole conversation as ``input`` each time, as the Agents SDK does with ``store``
off. Only what a chat completion can do is taken: text, function tools and structured output.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Discriminator, Field, StrictStr, Tag

from pagedserve.serving.openai.protocol import (
    APIRequest,
    Count,
    FunctionDefinition,
    FunctionName,
    Temperature,
    TopLogprobs,
    TopP,
    _only,
)

OUTPUT_TEXT_LOGPROBS = "message.output_text.logprobs"
"""The one ``include`` this server has: each output_text with its tokens' logprobs."""


def _includable(values: list[str]) -> list[str]:
    for value in values:
        if value != OUTPUT_TEXT_LOGPROBS:
            raise ValueError(f"include {value[:60]!r} is not supported by this server (only "
                             f"{OUTPUT_TEXT_LOGPROBS!r})")
    return values

__all__ = [
    "OUTPUT_TEXT_LOGPROBS",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionTool",
    "InputMessage",
    "JSONSchemaTextFormat",
    "ReasoningItem",
    "ResponsesRequest",
    "TextConfig",
]


class TextPart(APIRequest):
    """A message's text: ``input_text``, or ``output_text`` in an assistant turn replayed from
    an earlier response."""

    type: Literal["input_text", "output_text"]
    text: str
    # An earlier response's own output, sent back with it as history: it does not change the
    # text, so it is taken and left out of the prompt.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _text_or_list(item: Any) -> Any:
    """A string or a list of ``item``, whose errors are located at ``text`` or ``items``
    rather than at pydantic's names for the two types."""
    return Annotated[Annotated[StrictStr, Tag("text")] | Annotated[list[item], Tag("items")],
                     Discriminator(lambda v: "text" if isinstance(v, str) else "items")]


class InputMessage(APIRequest):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: _text_or_list(TextPart)
    id: str | None = None
    """Set on an output item replayed as input; not needed."""
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(APIRequest):
    """A call the model made earlier (an output item replayed as input)."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: FunctionName
    arguments: str
    """The arguments as a JSON text."""
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(APIRequest):
    """What the caller's function answered to the call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: _text_or_list(TextPart)
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningItem(APIRequest):
    """An earlier turn's reasoning, replayed from an earlier response's output. It stays out
    of the prompt, as chat templates leave past turns' reasoning out."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    status: str | None = None
    encrypted_content: _only("encrypted reasoning") = None


def _item_type(value: Any) -> str | None:
    # A message may leave its type out (OpenAI's "easy input message").
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(FunctionDefinition):
    """A function tool in the Responses shape: the definition's fields flat, not under
    ``function``."""

    type: Literal["function"]


class FunctionToolChoice(APIRequest):
    type: Literal["function"]
    name: FunctionName


class PlainTextFormat(APIRequest):
    type: Literal["text"]


class JSONObjectTextFormat(APIRequest):
    type: Literal["json_object"]


class JSONSchemaTextFormat(APIRequest):
    type: Literal["json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    # "schema" is a BaseModel attribute name, so the field is aliased.
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = Field(default=None, description=(
        "Accepted, true or false alike: the output is always constrained to follow `schema` "
        "(as if strict were true)."))


class TextConfig(APIRequest):
    format: Annotated[PlainTextFormat | JSONObjectTextFormat | JSONSchemaTextFormat,
                      Field(discriminator="type")] | None = None
    verbosity: _only("verbosity", "medium") = None


class ResponsesRequest(APIRequest):
    """``POST /v1/responses``: one model turn over ``input`` (text, or the conversation as
    items), answered as a chat completion would be and shaped as a Responses ``response``."""

    model: str | None = None
    input: _text_or_list(InputItem)
    instructions: str | None = None
    """A system message before the input."""
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    """False: at most one call."""
    text: TextConfig | None = None
    max_output_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    metadata: dict[Annotated[str, Field(max_length=64)],
                   Annotated[str, Field(max_length=512)]] | None = None
    """Returned with the response as given (it is not stored)."""
    user: str | None = None
    """The end user's id (OpenAI's abuse monitoring): no effect on the answer."""
    safety_identifier: str | None = None
    """OpenAI's successor to ``user``: no effect on the answer."""
    prompt_cache_key: str | None = None
    """OpenAI's prompt-cache routing hint: no effect here, as every prompt's prefix is
    cached."""
    # This server keeps no state: nothing is stored, nothing can be continued from.
    store: _only("stored responses (store: this server keeps no state)", False) = None
    previous_response_id: _only("previous_response_id (this server keeps no responses: send "
                                "the whole conversation as input)") = None
    conversation: _only("conversations (this server keeps no state)") = None
    background: _only("background responses", False) = None
    # OpenAI's fields this server does not implement
    include: Annotated[list[StrictStr], AfterValidator(_includable), Field(description=(
        f"Only {OUTPUT_TEXT_LOGPROBS!r}: each output_text carries its tokens' logprobs."
    ))] | None = None
    reasoning: _only("reasoning settings") = None
    truncation: _only("truncation other than disabled", "disabled") = None
    top_logprobs: TopLogprobs | None = None
    """Alternatives per token in the logprobs ``include`` asks for; as at OpenAI, without
    that no logprobs are shown."""
    max_tool_calls: _only("max_tool_calls") = None
    prompt: _only("prompt templates") = None
    service_tier: _only("service tiers", "auto", "default") = None
