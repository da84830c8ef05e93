"""What a request must satisfy before the engine takes it: checked once, at admission, with
nothing changed when it fails (each failure is a ``RequestError`` subclass)."""

from __future__ import annotations

from pagedserve.controller.errors import (
    EmptyPromptError,
    InvalidParamTokenError,
    InvalidTokenError,
    PromptTooLongError,
    RequestTooLargeError,
    UnsupportedRequestError,
)
from pagedserve.kv import KVCacheManager
from pagedserve.kv.errors import RequestTooLargeError as KVRequestTooLargeError
from pagedserve.messages import SamplingParams

__all__ = ["check_admission"]


def check_admission(
    ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int,
    has_tokenizer: bool, max_num_seqs: int, kv: KVCacheManager, priority: int = 0,
    policy: str = "fcfs",
) -> None:
    """Refuse an empty, too long or out-of-vocabulary prompt, stop, biased or allowed tokens
    outside the vocabulary, text features without a tokenizer, more samples than seats, and a
    request the KV cache could never hold, and a priority the scheduling policy ignores."""
    if priority != 0 and policy != "priority":
        raise UnsupportedRequestError(
            f"priority {priority} needs the priority scheduling policy (--scheduling-policy "
            f"priority); this engine's is {policy}")
    if not ids:
        raise EmptyPromptError("the prompt has no tokens")
    for pos, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidTokenError(
                f"prompt token {t!r} at position {pos} is outside the vocabulary "
                f"[0, {vocab_size})"
            )
    for field, ids_given in (("stop_token_ids", params.stop_token_ids),
                             ("logit_bias", [t for t, _ in params.logit_bias]),
                             ("allowed_token_ids", params.allowed_token_ids or ())):
        outside = [t for t in ids_given if not 0 <= t < vocab_size]
        if outside:
            raise InvalidParamTokenError(
                f"{field} {outside[:8]} reach outside the vocabulary [0, {vocab_size})")
    if len(ids) > max_model_len:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens, more than max_model_len={max_model_len}"
        )
    if (params.stop or params.structured_outputs) and not has_tokenizer:
        raise UnsupportedRequestError(
            "stop strings and structured outputs need a tokenizer; this engine has none")
    if params.n > max_num_seqs:
        raise UnsupportedRequestError(f"n={params.n} exceeds max_num_seqs={max_num_seqs}")
    # Peak KV slots of one sequence: the last sampled token is never written, and a sequence
    # stops when it reaches max_model_len.
    max_out = params.max_tokens if params.max_tokens is not None else max_model_len
    end = min(len(ids) + max_out, max_model_len)
    try:
        kv.check_admissible(max(len(ids), end - 1))
    except KVRequestTooLargeError as exc:
        raise RequestTooLargeError(f"the request can never fit in the KV cache: {exc}") from exc
