"""The ``ServerLimits`` checks of one API call, each raising the 400 that names the limit, the
offending parameter and the flag that raises it. They run before the work they guard: the
prompt's characters before tokenizing, the stop strings and logprob entries before the engine
sees the request."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagedserve.serving.openai.api_errors import APIError
from pagedserve.serving.openai.limits import ServerLimits

__all__ = ["check_logprob_entries", "check_prompt_chars", "check_stops"]


def _too_large(message: str, param: str, flag: str) -> APIError:
    return APIError(400, f"{message} (the server's --{flag})", param=param,
                    code="request_too_large")


def check_prompt_chars(
    limits: ServerLimits, max_model_len: int, sizes: Iterable[int], param: str
) -> None:
    """Every prompt's size in characters (``sizes``, one per prompt) within the limit."""
    limit = limits.prompt_chars_for(max_model_len)
    if limit is None:
        return
    for size in sizes:
        if size > limit:
            raise _too_large(
                f"the prompt has {size} characters, more than this server takes ({limit}) "
                "before tokenizing", param, "max-prompt-chars",
            )


def check_stops(limits: ServerLimits, stop: str | Sequence[str] | None) -> None:
    if stop is None:
        return
    stops = [stop] if isinstance(stop, str) else stop
    if limits.max_stop_strings is not None and len(stops) > limits.max_stop_strings:
        raise _too_large(f"{len(stops)} stop strings, more than {limits.max_stop_strings}",
                         "stop", "max-stop-strings")
    if limits.max_stop_chars is not None:
        for s in stops:
            if len(s) > limits.max_stop_chars:
                raise _too_large(
                    f"a stop string of {len(s)} characters, longer than "
                    f"{limits.max_stop_chars}", "stop", "max-stop-chars",
                )


def check_logprob_entries(
    limits: ServerLimits,
    *,
    prompt_lens: Sequence[int],
    n: int,
    max_tokens: int | None,
    top_n: int | None,
    echo: bool,
    max_model_len: int,
    prompt_top_n: int | None = None,
) -> None:
    """The answer's logprob entries within the limit: per prompt and choice, (the echoed
    prompt's tokens + the tokens generated at most) x (the sampled one + ``top_n``), and the
    prompt's tokens x (1 + ``prompt_top_n``) for ``prompt_logprobs`` (counted per choice, as a
    completion's answer repeats them in each)."""
    limit = limits.max_logprob_entries
    if limit is None or (top_n is None and prompt_top_n is None):
        return
    total = 0
    for plen in prompt_lens:
        generated = max_tokens if max_tokens is not None else max(0, max_model_len - plen)
        if top_n is not None:
            total += n * ((plen if echo else 0) + generated) * (1 + top_n)
        if prompt_top_n is not None:
            total += n * plen * (1 + prompt_top_n)
    if total > limit:
        param = "logprobs" if top_n is not None else "prompt_logprobs"
        raise _too_large(
            f"this request asks for up to {total} logprob entries (prompts x n x (echoed "
            f"prompt tokens + max_tokens) x (1 + logprobs), and prompt tokens x (1 + "
            f"prompt_logprobs)), more than {limit}; lower n, logprobs, prompt_logprobs or "
            "max_tokens", param, "max-logprob-entries",
        )
