"""The OpenAI Batch API's line format: input lines, output and error records, resumption.

An input line is ``{"custom_id": str, "method": "POST", "url": <endpoint>, "body": {...}}``.
An output record is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error": null}``. An error record has ``"error": {"code", "message"}``, and ``response`` null
when the line never reached an endpoint (a malformed line) or the endpoint's error answer
(status and OpenAI error body) when the endpoint refused the body.

The format is shared by the online Batch API (``batch_api.runner``) and, through
``job_fields``, by ``pagedserve generate --input`` (``jsonl_job.job``).
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.serving.request_fields import CONSTRAINT_FIELDS

__all__ = [
    "BATCH_ENDPOINTS",
    "DUPLICATE",
    "JOB_ENDPOINTS",
    "BatchLine",
    "LineTracker",
    "input_lines",
    "job_fields",
    "parse_line",
    "record",
]

# A ``generate --input`` job line asks for a completion or a chat reply; the Batch API runs
# Responses lines too (through the server's endpoint, which the job does without).
JOB_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
BATCH_ENDPOINTS = (*JOB_ENDPOINTS, "/v1/responses")
DUPLICATE = "duplicate_custom_id"


@dataclass(slots=True)
class BatchLine:
    custom_id: str | None
    body: dict[str, Any] | None = None
    error: tuple[str, str] | None = None
    """(code, message) when the line cannot be served."""


def parse_line(lineno: int, text: str, endpoint: str) -> BatchLine:
    """Check the envelope of one input line (not the body: the endpoint checks that)."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep to parse
        return BatchLine(None, error=("invalid_json", f"line {lineno}: not valid JSON: {exc}"))
    if not isinstance(obj, dict):
        return BatchLine(None, error=("invalid_request", f"line {lineno}: not a JSON object"))
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return BatchLine(None, error=(
            "missing_custom_id", f"line {lineno}: custom_id must be a non-empty string"))
    method = obj.get("method")
    if method != "POST":
        return BatchLine(cid, error=(
            "invalid_method", f"line {lineno}: method must be \"POST\", got {method!r}"))
    url = obj.get("url")
    if url != endpoint:
        return BatchLine(cid, error=(
            "invalid_url", f"line {lineno}: url {url!r} is not this batch's endpoint {endpoint}"))
    body = obj.get("body")
    if not isinstance(body, dict):
        return BatchLine(cid, error=("invalid_body", f"line {lineno}: body must be a JSON object"))
    return BatchLine(cid, body)


def input_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of every non-blank line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, text in enumerate(f, start=1):
            if text.strip():
                yield lineno, text


def record(custom_id: str | None, response: Any = None, error: Any = None) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": response, "error": error}


class LineTracker:
    """Follows a scan of the input in file order: flags repeated custom_ids, and tells which
    lines an earlier run already wrote (from ``(custom_id, error code)`` of its records).

    A custom_id's first line is done when any record carries that id (and is not a repeat's
    error). Repeats and lines without a custom_id are written as they are met, in file
    order, so the first k of them (per custom_id, or per "none") are done when k were written.
    """

    def __init__(self, written: Iterable[tuple[Any, str | None]]) -> None:
        self._done: set[str] = set()
        self._others_written: Counter[str | None] = Counter()
        for key, code in written:
            if isinstance(key, str) and code != DUPLICATE:
                self._done.add(key)
            else:
                self._others_written[key if isinstance(key, str) else None] += 1
        self._first: dict[str, int] = {}
        self._others: Counter[str | None] = Counter()

    def already_done(self, lineno: int, line: BatchLine) -> bool:
        """Call once per line, in order; marks a repeat as an error."""
        cid = line.custom_id
        if cid is not None and cid not in self._first:
            self._first[cid] = lineno
            return cid in self._done
        if cid is not None:
            line.error = (DUPLICATE, f"line {lineno}: custom_id {cid!r} was already used on "
                                     f"line {self._first[cid]}")
        self._others[cid] += 1
        return self._others[cid] <= self._others_written[cid]


# Body fields of an OpenAI request that a ``generate --input`` job line takes as they are.
_JOB_BODY_FIELDS = (
    "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "ignore_eos",
    "min_tokens", "min_p", "stop_token_ids", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "cache_salt", *CONSTRAINT_FIELDS,
)


def job_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """A Batch API line as the fields of a ``generate --input`` line (``id`` = custom_id;
    ``prompt`` / ``prompt_token_ids`` from a completion body, ``messages`` from a chat body;
    body fields the job has no use for, such as ``model``, are dropped). Raises ValueError."""
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise ValueError("custom_id must be a non-empty string")
    if obj.get("method", "POST") != "POST":
        raise ValueError(f"method must be \"POST\", got {obj.get('method')!r}")
    url = obj.get("url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    if url is None:
        url = JOB_ENDPOINTS[1] if "messages" in body else JOB_ENDPOINTS[0]
    if url not in JOB_ENDPOINTS:
        raise ValueError(f"url must be one of {', '.join(JOB_ENDPOINTS)}, got {url!r}")
    fields: dict[str, Any] = {k: body[k] for k in _JOB_BODY_FIELDS if body.get(k) is not None}
    if body.get("max_completion_tokens") is not None:
        fields["max_tokens"] = body["max_completion_tokens"]
    if url == JOB_ENDPOINTS[1]:
        fields["messages"] = body.get("messages")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            fields["prompt_token_ids"] = prompt
        else:
            fields["prompt"] = prompt
    fields["id"] = cid
    return fields
