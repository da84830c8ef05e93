"""How to sample one request: ``SamplingParams``, validated once at construction.

It crosses process boundaries inside ``messages.py``'s messages (and is re-exported there).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from pagedserve.config import FieldError

__all__ = [
    "INT32_MAX", "LOGIT_BIAS", "RANGES", "TOKEN_ID", "Range", "SamplingParams",
    "SamplingParamsError", "StructuredOutputsParams",
]

INT32_MAX = 2**31 - 1
"""The largest count or token id a request may carry: the workers hold token ids in int32
matrices and the per-row parameters in fixed-width columns, where a wider value would fail the
whole batch's step instead of this request's admission."""


class SamplingParamsError(FieldError):
    """An invalid sampling parameter; ``field`` names it."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True, slots=True)
class Range:
    """The values a numeric field accepts: ``[lo, hi]``, or ``(lo, hi]`` with ``lo_open``.

    One table (``RANGES``) serves ``SamplingParams`` and the HTTP request models alike, so the
    server's 400s and the engine's refusals agree on every bound."""

    lo: int | float
    hi: int | float
    integer: bool = False
    lo_open: bool = False
    note: str = ""

    def admits(self, v: Any) -> bool:
        if not (_is_int(v) if self.integer else _is_num(v)):
            return False
        return (self.lo < v if self.lo_open else self.lo <= v) and v <= self.hi

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        return f"must be {kind} in {'(' if self.lo_open else '['}{self.lo}, {self.hi}]{self.note}"


TOKEN_ID = Range(0, INT32_MAX, integer=True)
"""Any token id before the vocabulary is known (the engine checks ``< vocab_size``)."""
LOGIT_BIAS = Range(-100.0, 100.0)
"""A ``logit_bias`` value's bounds (OpenAI's)."""

RANGES: dict[str, Range] = {
    "n": Range(1, 128, integer=True),
    "max_tokens": Range(0, INT32_MAX, integer=True),
    "min_tokens": Range(0, INT32_MAX, integer=True),
    "temperature": Range(0.0, 100.0),
    "top_p": Range(0.0, 1.0, lo_open=True),
    "top_k": Range(-1, INT32_MAX, integer=True, note=" (0 or -1 disables it)"),
    "min_p": Range(0.0, 1.0),
    "seed": Range(0, 2**63 - 1, integer=True),
    "stop_token_ids": TOKEN_ID,  # each of them
    "repetition_penalty": Range(0.0, 10.0, lo_open=True),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "logprobs": Range(0, 20, integer=True),
    "prompt_logprobs": Range(0, 20, integer=True),
}
"""Every numeric parameter's bounds, by ``SamplingParams`` field name."""

@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate, as vLLM's ``StructuredOutputsParams``
    spells it: exactly one of a JSON Schema (``json``; a dict is kept as its JSON text),
    any JSON object (``json_object``), a regular expression, a choice among strings, or a
    grammar (Lark, or GBNF as llama.cpp writes it). The controller compiles it and masks every
    sampled position to the tokens that keep the output inside it. JSON may carry
    whitespace between its tokens, as in vLLM, one space or a line break and an indent at a
    time (bounded, as llama.cpp bounds it, so that a sampled model cannot pad forever:
    ``controller/json_grammar.py``); ``disable_any_whitespace`` allows only ``", "`` and
    ``": "``."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, list, bool)):
            # Key order is kept: a schema's property order is the output's.
            object.__setattr__(self, "json", json.dumps(self.json))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs", "exactly one of json, json_object, regex, choice and "
                f"grammar must be given, got {given or 'none'}")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise SamplingParamsError("structured_outputs", f"{name} must be non-empty text")
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise SamplingParamsError("structured_outputs", "choice must be non-empty strings")
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError("structured_outputs", f"{name} must be a boolean")

    @property
    def kind(self) -> str:
        """Which constraint is given: json, json_object, regex, choice or grammar."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json", "regex", "choice", "grammar")
                    if getattr(self, n) is not None)


_OPTIONAL = frozenset({"max_tokens", "seed", "logprobs", "prompt_logprobs"})


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request. Defaults follow vLLM / the OpenAI API.

    ``temperature == 0`` is greedy. ``top_k`` of 0 or -1 disables top-k. ``seed`` makes the
    request's samples reproducible whatever else shares its batch. ``logprobs`` asks for the
    sampled token's log-probability plus that many top alternatives; ``prompt_logprobs`` asks
    for each prompt token's log-probability given the tokens before it (position 0 has none),
    plus that many top alternatives. ``max_tokens == 0`` computes the prompt and generates
    nothing (scoring a prompt through its ``prompt_logprobs``). ``structured_outputs``
    constrains the output to a schema, a regex, a choice or a grammar. ``logit_bias`` adds a
    bias (in [-100, 100], as OpenAI bounds it) to given tokens' logits before sampling;
    ``allowed_token_ids`` samples among those tokens only (both leave the reported logprobs
    raw, as vLLM's default). ``include_stop_str_in_output`` keeps the stop string (or stop
    token's text) that ended a sequence at the end of its text.
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
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs, one per token; a dict is accepted and frozen in id order."""
    allowed_token_ids: tuple[int, ...] | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # Lists (and the bias's dict) are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        for name in ("stop_token_ids", "allowed_token_ids"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = sorted(bias.items(), key=lambda kv: (not _is_int(kv[0]), str(kv[0])))
        if isinstance(bias, (list, tuple)):
            object.__setattr__(self, "logit_bias", tuple(
                tuple(pair) if isinstance(pair, (list, tuple)) else pair for pair in bias))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> SamplingParamsError:
            return SamplingParamsError(name, f"{rule}, got {getattr(self, name)!r}")

        for name, allowed in RANGES.items():
            value = getattr(self, name)
            if name == "stop_token_ids":
                if not all(allowed.admits(t) for t in value):
                    raise bad(name, "each " + allowed.describe())
            elif not (value is None and name in _OPTIONAL) and not allowed.admits(value):
                raise bad(name, allowed.describe())
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens={self.max_tokens}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a boolean")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")
        if not isinstance(self.logit_bias, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and TOKEN_ID.admits(p[0])
            and LOGIT_BIAS.admits(p[1]) for p in self.logit_bias
        ):
            raise bad("logit_bias", "must map token ids to biases in [-100, 100]")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise bad("logit_bias", "must give each token one bias")
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, tuple) or not allowed
                                    or not all(TOKEN_ID.admits(t) for t in allowed)):
            raise bad("allowed_token_ids", "must be a non-empty list of token ids")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise bad("include_stop_str_in_output", "must be a boolean")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
