"""The API's errors: the OpenAI error body, the 500 that hides its detail behind a request
id, and the translation of pydantic's and the engine's refusals into them."""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

from pagedserve.controller.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidParamTokenError,
    InvalidTokenError,
    PromptTooLongError,
    RequestError,
    RequestTooLargeError,
    UnsupportedRequestError,
)

__all__ = [
    "REQUEST_ID",
    "APIError",
    "InternalError",
    "current_request_id",
    "engine_unavailable",
    "submit_error",
    "validation_error",
]

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered with the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        """Sent as ``Retry-After`` (a 503 the client may retry)."""

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


REQUEST_ID: ContextVar[str | None] = ContextVar("pagedserve_request_id", default=None)
"""The id of the HTTP request being served (set by ``request_ids.RequestIdMiddleware``)."""


def current_request_id() -> str | None:
    return REQUEST_ID.get()


class InternalError(APIError):
    """A 500: the server failed while serving a request. ``detail`` goes to the log under the
    request's id (with the traceback of the exception being handled, if any); the client reads
    only "internal error (request id ...)", the id its ``X-Request-Id`` header carries too.
    Outside an HTTP request (a batch line) the error gets an id of its own."""

    def __init__(self, detail: str) -> None:
        self.request_id = current_request_id() or uuid.uuid4().hex
        super().__init__(500, f"internal error (request id {self.request_id})",
                         type="server_error", code="internal_error")
        logger.error("request %s: internal error: %s", self.request_id, detail,
                     exc_info=sys.exc_info()[0] is not None)


# A 503 says when to come back: the engine is gone (every replica's controller lost past its
# restarts) until whoever runs the server restarts it, so not at once; a full engine drains
# within seconds.
UNAVAILABLE_RETRY_AFTER_S = 10
OVERLOADED_RETRY_AFTER_S = 1


def engine_unavailable(reason: str = "the engine is not running") -> APIError:
    return APIError(503, reason, type="service_unavailable_error", code="engine_unavailable",
                    retry_after_s=UNAVAILABLE_RETRY_AFTER_S)


def validation_error(errors: Sequence[Any]) -> APIError:
    """The 400 answer to a body that failed pydantic validation (pydantic's ``errors()``)."""
    if not errors:
        return APIError(400, "invalid request body")
    # A union reports every branch that did not apply; an unknown field, or a failed check
    # (ours), says why.
    first = next((e for e in errors if e.get("type") == "extra_forbidden"),
                 next((e for e in errors if e.get("type") == "value_error"), errors[0]))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('msg', '')}")
    where = ".".join(loc) or "body"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unknown field `{where}`: this server does not take it{more}",
                        param=where, code="unknown_field")
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    code = "unsupported_field" if msg.endswith("is not supported by this server") else None
    return APIError(400, f"{where}: {msg}{more}", param=loc[0] if loc else None, code=code)


def submit_error(exc: BaseException, prompt_param: str) -> APIError:
    """Translate what ``add_request`` raised into the API's error."""
    if isinstance(exc, EngineDeadError):
        return engine_unavailable(f"the engine is not running: {exc}")
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), type="service_unavailable_error", code="engine_overloaded",
                        retry_after_s=OVERLOADED_RETRY_AFTER_S)
    if isinstance(exc, RequestError):
        param: str | None = None
        if isinstance(exc, (EmptyPromptError, InvalidTokenError, PromptTooLongError)):
            param = prompt_param
        elif isinstance(exc, InvalidParamTokenError):
            param = InvalidParamTokenError.field_of(str(exc))
        elif isinstance(exc, RequestTooLargeError):
            param = "max_tokens"
        elif isinstance(exc, DuplicateRequestError):
            param = "request_id"
        elif isinstance(exc, UnsupportedRequestError) and str(exc).startswith("priority "):
            param = "priority"
        return APIError(400, str(exc), param=param, code=type(exc).__name__)
    return APIError(400, str(exc))

