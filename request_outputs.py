"""What a user gets back: ``RequestOutput`` (a request's whole output so far) with its
``CompletionOutput``s, and the per-step ``RequestDelta`` / ``CompletionDelta`` the engine emits
and an accumulator folds into them.

They cross process boundaries inside ``messages.py``'s messages (and are re-exported there).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CompletionDelta", "CompletionOutput", "RequestDelta", "RequestOutput"]


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's ``n`` completions."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """``stop`` (EOS, stop token or stop string), ``length``, ``abort`` or ``error``."""
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    tool_calls: list[dict[str, str]] | None = None
    """From ``LLM.chat`` with ``tools`` (unless ``tool_choice`` is ``none``): the calls the text
    makes, each ``{"id", "name", "arguments"}`` (the arguments' JSON text); ``text`` stays the
    whole text the model wrote."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """One request's whole output so far (built from its ``RequestDelta``s by an accumulator)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """With ``prompt_logprobs`` asked for: per prompt position, ``{prompt token: logprob,
    top_1: logprob, ...}`` (the prompt token first); None at position 0."""
    num_host_cached_tokens: int = 0
    """Of ``num_cached_tokens``, those found in the host tier (copied back, not recomputed)."""
    error_code: str | None = None
    """With ``error``: the ``controller.errors`` class it stands for (``RequestFailedError``:
    this request alone failed, the engine serves on); None for a failure of the engine."""


@dataclass(slots=True)
class CompletionDelta:
    """What one completion gained in one engine step. Text is append-only: while stop strings
    may still match, the engine holds back the characters that could start one."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class RequestDelta:
    """One step's output of one request: the completions that progressed (only their new
    tokens, text and logprobs), and whether the request is finished. ``error`` is set when the
    engine failed the request (its unfinished completions end with ``finish_reason="error"``)."""

    request_id: str
    completions: list[CompletionDelta]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """The prompt positions whose logprobs became known this step (``RequestOutput``'s
    ``prompt_logprobs``, in order, each sent once); None when there are none."""
    num_host_cached_tokens: int = 0
    error_code: str | None = None
    """With ``error``: as ``RequestOutput.error_code``."""
