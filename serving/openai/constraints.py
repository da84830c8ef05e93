"""A request's structured-output constraint, from whichever field spells it: OpenAI's
``response_format``, vLLM's ``structured_outputs`` or its older ``guided_*`` fields. At most
one of them may be given; an invalid one is a 400 naming it."""

from __future__ import annotations

from typing import Any

from pagedserve.messages import SamplingParamsError, StructuredOutputsParams
from pagedserve.serving.openai.api_errors import APIError
from pagedserve.serving.openai.protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["constraint_of"]

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def _given(body: CompletionRequest | ChatCompletionRequest) -> dict[str, dict[str, Any]]:
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
            raise APIError(400, "response_format of type json_schema needs its json_schema",
                           param="response_format.json_schema")
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


def constraint_of(
    body: CompletionRequest | ChatCompletionRequest,
) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field that gave it (both None without one)."""
    given = _given(body)
    if len(given) > 1:
        names = ", ".join(given)
        raise APIError(400, f"only one structured-output field may be given, got {names}",
                       param=next(iter(given)))
    if not given:
        return None, None
    (param, args), = given.items()
    try:
        return StructuredOutputsParams(**args), param
    except SamplingParamsError as exc:
        raise APIError(400, f"{param}: {exc.message}", param=param) from None
