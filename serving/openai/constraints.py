"""A request's structured-output constraint, from whichever field spells it: OpenAI's
``response_format``, vLLM's ``structured_outputs`` or its older ``guided_*`` fields. At most
one of them may be given; an invalid one is a 400 naming it. The rules are the front ends'
shared ones (``serving.request_fields``); this module only answers them as HTTP errors."""

from __future__ import annotations

from pagedserve.messages import StructuredOutputsParams
from pagedserve.serving.openai.api_errors import APIError
from pagedserve.serving.request_fields import ConstraintError, ConstraintFields
from pagedserve.serving.request_fields import constraint_of as _constraint_of

__all__ = ["constraint_of"]


def constraint_of(
    body: ConstraintFields,
) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field that gave it (both None without one)."""
    try:
        return _constraint_of(body)
    except ConstraintError as exc:
        raise APIError(400, exc.message, param=exc.param) from None
