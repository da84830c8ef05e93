"""Typed errors: requests the engine refuses, and the engine being down.

Every ``RequestError`` is raised at admission, before the engine changes any state, so a caller
that catches it can carry on and the other requests are unaffected. A refusal travels to clients
as an ``AddResult`` naming its code (``error_code``), and ``error_from_code`` raises the same
class on the other side, in-process and over the wire alike.
"""

from __future__ import annotations

from pagedserve.kv.errors import RequestTooLargeError as _KVRequestTooLargeError

__all__ = [
    "ControllerLostError",
    "DuplicateRequestError",
    "EngineDeadError",
    "EngineOverloadedError",
    "EmptyPromptError",
    "InvalidGrammarError",
    "InvalidTokenError",
    "InvalidParamTokenError",
    "PromptTooLongError",
    "RequestError",
    "RequestFailedError",
    "RequestTooLargeError",
    "UnknownRequestError",
    "UnsupportedRequestError",
    "error_code",
    "error_from_code",
]


class RequestError(ValueError):
    """Base class: this request cannot be served as given."""


class EmptyPromptError(RequestError):
    """The prompt has no tokens; there is nothing to condition the first sample on."""


class PromptTooLongError(RequestError):
    """The prompt is longer than the model's context (``max_model_len``)."""


class InvalidTokenError(RequestError):
    """A prompt token id lies outside ``[0, vocab_size)``."""


class InvalidParamTokenError(RequestError):
    """A token id of the sampling parameters (``stop_token_ids``, ``logit_bias``,
    ``allowed_token_ids``) lies outside ``[0, vocab_size)``. The message starts with the
    field's name (``field_of`` reads it back after the error crossed the wire)."""

    @staticmethod
    def field_of(message: str) -> str:
        return message.split(" ", 1)[0]


class InvalidGrammarError(RequestError):
    """The structured-output constraint (a JSON Schema, regex, choice or grammar) does not
    compile; the message says where."""


class DuplicateRequestError(RequestError):
    """The request id is already in use by an unfinished request."""


class UnsupportedRequestError(RequestError):
    """The request asks for something this engine cannot do (e.g. stop strings without a
    tokenizer, or more parallel samples than ``max_num_seqs``)."""


class RequestTooLargeError(RequestError, _KVRequestTooLargeError):
    """Even alone, the request would need more KV blocks than the whole cache holds.

    Subclasses kv's error too, so ``except`` clauses written against either layer catch it.
    """


class UnknownRequestError(RequestError, KeyError):
    """No unfinished request has this id."""


class EngineOverloadedError(RequestError):
    """The engine already holds ``max_pending_requests`` requests: try again later."""


class EngineDeadError(RuntimeError):
    """The engine stopped (its workers could not be rebuilt, or it was shut down); in-flight
    requests failed."""


class ControllerLostError(EngineDeadError):
    """The controller actor serving the request died (or fell silent and was killed). A front
    end that can start another one moves the request there (``controller.resume``); only one
    that cannot lets this reach its caller."""


class RequestFailedError(RuntimeError):
    """The engine failed this request alone while serving it (the workers could not take a
    value that the checks at admission missed, or it could not be scheduled); the other
    requests and the engine carry on."""


_BY_CODE: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        RequestError,
        EmptyPromptError,
        PromptTooLongError,
        InvalidTokenError,
        InvalidParamTokenError,
        InvalidGrammarError,
        DuplicateRequestError,
        UnsupportedRequestError,
        RequestTooLargeError,
        UnknownRequestError,
        EngineOverloadedError,
        EngineDeadError,
        ControllerLostError,
        RequestFailedError,
    )
}


def error_code(exc: BaseException) -> str:
    """The code an ``AddResult`` carries for ``exc``: its class name when it is one of ours,
    else ``RequestError`` (a ``ValueError`` from parameter checks)."""
    name = type(exc).__name__
    return name if name in _BY_CODE else "RequestError"


def error_from_code(code: str, message: str) -> Exception:
    """The exception an ``AddResult`` refusal stands for."""
    return _BY_CODE.get(code, RequestError)(message)
