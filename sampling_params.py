"""How to sample one request: ``SamplingParams``, validated once at construction.

It crosses process boundaries inside ``messages.py``'s messages (and is re-exported there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pagedserve.config import FieldError

__all__ = ["SamplingParams", "SamplingParamsError"]


class SamplingParamsError(FieldError):
    """An invalid sampling parameter; ``field`` names it."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request. Defaults follow vLLM / the OpenAI API.

    ``temperature == 0`` is greedy. ``top_k`` of 0 or -1 disables top-k. ``seed`` makes the
    request's samples reproducible whatever else shares its batch. ``logprobs`` asks for the
    sampled token's log-probability plus that many top alternatives; ``prompt_logprobs`` asks
    for each prompt token's log-probability given the tokens before it (position 0 has none),
    plus that many top alternatives. ``max_tokens == 0`` computes the prompt and generates
    nothing (scoring a prompt through its ``prompt_logprobs``).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> SamplingParamsError:
            return SamplingParamsError(name, f"{rule}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or not 1 <= self.n <= 128:
            raise bad("n", "must be an integer in [1, 128]")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            raise bad("max_tokens", "must be an integer >= 0")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens={self.max_tokens}")
        if not _is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be a number in [0, 100]")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= -1 (0 or -1 disables it)")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be a number in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", "must be an integer in [0, 2**63)")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a boolean")
        if not _is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", "must be a number in (0, 10]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_num(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be a number in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):
            lp = getattr(self, name)
            if lp is not None and (not _is_int(lp) or not 0 <= lp <= 20):
                raise bad(name, "must be an integer in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
