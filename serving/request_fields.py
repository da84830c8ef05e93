"""Request-body pieces that every front end reads alike: the strict base of a request body and
the fields that set a structured-output constraint (OpenAI's ``response_format``, vLLM's
``structured_outputs`` and its older ``guided_*``).

They live outside the HTTP server so that the JSONL job, which needs no server, validates a
line's constraint with the very models and rules the server applies to a request body.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator

from pagedserve.sampling_params import SamplingParamsError, StructuredOutputsParams

__all__ = [
    "CONSTRAINT_FIELDS",
    "APIRequest",
    "ConstraintError",
    "ConstraintFields",
    "JSONSchemaFormat",
    "ResponseFormat",
    "StructuredOutputs",
    "constraint_of",
]


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
    """Base of every request body: an unknown field refused by name, every text valid
    Unicode."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        _check_text(value)
        return value


class JSONSchemaFormat(APIRequest):
    name: str = "response"
    description: str | None = None
    # "schema" is a BaseModel attribute name, so the field is aliased.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = Field(default=None, description=(
        "Accepted, true or false alike: the output is always constrained to follow `schema` "
        "(as if strict were true)."))


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


class ConstraintFields(APIRequest):
    """The request fields that may set a constraint (at most one of them may)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older spellings of structured_outputs' fields
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None


CONSTRAINT_FIELDS = tuple(ConstraintFields.model_fields)

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


class ConstraintError(ValueError):
    """A request's constraint fields are invalid; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _given(body: ConstraintFields) -> dict[str, dict[str, Any]]:
    """Per request field that sets a constraint, its ``StructuredOutputsParams`` arguments.
    A ``structured_outputs`` that sets only ``disable_any_whitespace`` is no constraint of
    its own: it applies to ``response_format``'s JSON (OpenAI's field has no such option)."""
    found: dict[str, dict[str, Any]] = {}
    so = body.structured_outputs
    compact = {"disable_any_whitespace": so.disable_any_whitespace} if so is not None else {}
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found["response_format"] = {"json_object": True} | compact
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ConstraintError("response_format of type json_schema needs its json_schema",
                                  "response_format.json_schema")
        found["response_format"] = {"json": fmt.json_schema.json_schema} | compact
    if so is not None:
        args = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                  ("grammar", so.grammar), ("json_object", so.json_object))
                if v is not None}
        if args or "response_format" not in found:
            found["structured_outputs"] = args | compact
    for name, kind in _GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            found[name] = {kind: value}
    return found


def constraint_of(body: ConstraintFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field that gave it (both None without one); raises
    ``ConstraintError`` for two constraints at once or an invalid one."""
    given = _given(body)
    if len(given) > 1:
        names = ", ".join(given)
        raise ConstraintError(f"only one structured-output field may be given, got {names}",
                              next(iter(given)))
    if not given:
        return None, None
    (param, args), = given.items()
    try:
        return StructuredOutputsParams(**args), param
    except SamplingParamsError as exc:
        raise ConstraintError(f"{param}: {exc.message}", param) from None
