"""One line of a JSONL generate job: parsing it into a request, and its output records.

Shared by ``pagedserve generate --input`` (``jsonl_job/job.py``) and anything else that reads the
same lines. A line that cannot be served raises ``LineError`` with the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from pagedserve.controller.tokenizer import Tokenizer
from pagedserve.messages import (
    RequestOutput,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)
from pagedserve.serving.batch_api.records import job_fields
from pagedserve.serving.chat import ChatError, render_chat
from pagedserve.serving.request_fields import (
    CONSTRAINT_FIELDS,
    ConstraintError,
    ConstraintFields,
    constraint_of,
)

__all__ = [
    "Item", "LineError", "error_record", "id_key", "line_id", "parse_line", "result_record",
]

# Per-line sampling fields (a subset of ``SamplingParams``) and the other keys a line may carry.
SAMPLING_FIELDS = (
    "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "ignore_eos",
    "min_tokens", "min_p", "stop_token_ids", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "prompt_logprobs",
)
PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")
OTHER_FIELDS = ("id", "cache_salt", "metadata", "custom_id")
MIN_LOGPROB = -9999.0  # -inf is not JSON


class LineError(ValueError):
    """This input line cannot become a request; the message says why."""


@dataclass(slots=True)
class Item:
    """One parsed input line, ready to submit."""

    line: int
    id: Any
    key: str
    token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    cache_salt: str | None
    metadata: Any
    custom_id: str | None = None


def id_key(value: Any) -> str:
    """How ids are compared across runs: 3 and "3" stay different."""
    return json.dumps(value, sort_keys=True)


def line_id(lineno: int, obj: Any) -> Any:
    key = "custom_id" if isinstance(obj, dict) and "custom_id" in obj else "id"
    if isinstance(obj, dict) and key in obj:
        rid = obj[key]
        if isinstance(rid, str) or (isinstance(rid, int) and not isinstance(rid, bool)):
            return rid
    return lineno


def _encode_prompt(
    obj: dict[str, Any], tokenizer: Tokenizer | None
) -> tuple[list[int], str | None]:
    given = [k for k in PROMPT_FIELDS if k in obj]
    if len(given) != 1:
        what = "none" if not given else ", ".join(given)
        raise LineError(f"exactly one of prompt, prompt_token_ids, messages is needed (got {what})")
    kind = given[0]
    value = obj[kind]
    if kind == "prompt_token_ids":
        if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        ):
            raise LineError("prompt_token_ids must be a list of integers")
        return list(value), None
    if tokenizer is None:
        raise LineError(f"{kind} needs a tokenizer and the model has none; use prompt_token_ids")
    if kind == "prompt":
        if not isinstance(value, str):
            raise LineError("prompt must be a string")
        return tokenizer.encode(value), value
    try:
        return render_chat(tokenizer, value)[1], None
    except ChatError as exc:
        raise LineError(str(exc)) from exc


def _constraint(obj: dict[str, Any]) -> StructuredOutputsParams | None:
    """The line's structured-output constraint, read by the HTTP server's rules: the same
    fields (``response_format``, ``structured_outputs``, ``guided_*``), the same errors."""
    fields = {k: obj[k] for k in CONSTRAINT_FIELDS if obj.get(k) is not None}
    if not fields:
        return None
    try:
        return constraint_of(ConstraintFields.model_validate(fields))[0]
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise LineError(f"invalid {where}: {first['msg']}") from None
    except ConstraintError as exc:
        raise LineError(exc.message) from None


def parse_line(
    lineno: int, text: str, defaults: dict[str, Any], tokenizer: Tokenizer | None
) -> Item:
    """Turn one input line into a request, or raise ``LineError``."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise LineError(f"invalid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise LineError("a line must be a JSON object")
    if "custom_id" in obj or "body" in obj:  # the OpenAI Batch API's line format
        try:
            obj = {**job_fields(obj), "custom_id": obj.get("custom_id")}
        except ValueError as exc:
            raise LineError(str(exc)) from exc
    unknown = sorted(set(obj) - set(SAMPLING_FIELDS) - set(PROMPT_FIELDS) - set(OTHER_FIELDS)
                     - set(CONSTRAINT_FIELDS))
    if unknown:
        raise LineError(f"unknown field(s): {', '.join(unknown)}")
    rid = obj.get("id", lineno)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise LineError("id must be a string or an integer")
    salt = obj.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise LineError("cache_salt must be a string")
    token_ids, prompt = _encode_prompt(obj, tokenizer)
    options = {**defaults, **{k: obj[k] for k in SAMPLING_FIELDS if k in obj}}
    constraint = _constraint(obj)
    if constraint is not None:
        options["structured_outputs"] = constraint
    try:
        params = SamplingParams(**options)
    except SamplingParamsError as exc:
        raise LineError(f"invalid sampling parameter {exc}") from exc
    except TypeError as exc:
        raise LineError(f"invalid sampling parameters: {exc}") from exc
    return Item(lineno, rid, id_key(rid), token_ids, params, prompt, salt, obj.get("metadata"),
                 obj.get("custom_id"))


def result_record(item: Item, out: RequestOutput) -> dict[str, Any]:
    """The output record of a finished request."""
    comps = sorted(out.outputs, key=lambda c: c.index)
    completion_tokens = sum(len(c.token_ids) for c in comps)
    rec: dict[str, Any] = {"id": item.id, "line": item.line}
    if item.custom_id is not None:
        rec["custom_id"] = item.custom_id
    if item.prompt is not None:
        rec["prompt"] = item.prompt
    first = comps[0]
    rec.update(text=first.text, token_ids=list(first.token_ids), finish_reason=first.finish_reason)
    if len(comps) > 1:
        rec["choices"] = [
            {"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
             "finish_reason": c.finish_reason}
            for c in comps
        ]
    rec["usage"] = {
        "prompt_tokens": len(item.token_ids),
        "completion_tokens": completion_tokens,
        "total_tokens": len(item.token_ids) + completion_tokens,
        "cached_tokens": out.num_cached_tokens,
    }
    if out.prompt_logprobs is not None:
        num = item.params.prompt_logprobs or 0
        rec["prompt_logprobs"] = [_prompt_entry(e, num) for e in out.prompt_logprobs]
    if item.metadata is not None:
        rec["metadata"] = item.metadata
    return rec


def _prompt_entry(entry: dict[int, float] | None, num: int) -> dict[str, Any] | None:
    """One prompt position in a record: the prompt token's id and logprob, and the ``num``
    most likely tokens as ``[id, logprob]`` pairs, most likely first (None at position 0)."""
    if entry is None:
        return None
    token_id, logprob = next(iter(entry.items()))
    top = sorted(entry.items(), key=lambda kv: -kv[1])[:num]
    return {
        "token_id": token_id,
        "logprob": max(logprob, MIN_LOGPROB),
        "top_logprobs": [[t, max(v, MIN_LOGPROB)] for t, v in top],
    }


def error_record(lineno: int, rid: Any, exc: BaseException, metadata: Any = None) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "id": rid, "line": lineno, "error": str(exc), "error_type": type(exc).__name__,
    }
    if metadata is not None:
        rec["metadata"] = metadata
    return rec


