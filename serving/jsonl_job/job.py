"""The JSONL generate job: ``pagedserve generate --input in.jsonl --output out.jsonl``.

Each input line is one request: ``prompt`` (text), ``prompt_token_ids`` or ``messages`` (chat,
rendered through the tokenizer's chat template), an optional ``id`` (the 1-based line number
otherwise) and optional sampling fields overriding the command-line defaults. Every line gets
exactly one output record, appended and flushed the moment it is known, so a job that dies
loses nothing: rerunning it with the same output file skips every id already written (a
truncated last record is cut off first) and does only the rest. A line in the OpenAI Batch API's
format (``custom_id``, ``method``, ``url``, ``body``) is accepted too: its ``custom_id`` is the
id, its body's prompt or messages and sampling fields are the line's, and its records keep
``custom_id``. A line may carry a structured-output constraint as a request body does
(``response_format``, ``structured_outputs`` or ``guided_*``), read by the server's own rules
(``serving.request_fields``); an invalid one fails its line alone.

A line that cannot be served (bad JSON, no prompt, an invalid sampling value, a prompt that is
too long or has out-of-vocabulary ids) becomes an error record carrying its line number; the
job goes on. A line with ``prompt_logprobs: N`` gets the prompt's log-probabilities in its
record (``prompt_logprobs``: null for the first token, then ``{token_id, logprob,
top_logprobs: [[id, logprob], ...]}`` per prompt token). The exit status is the number of
failed lines (capped at 125), 0 when none failed.
Requests the engine could not finish because it died are *not* written, so a rerun retries them.

The job talks to the engine only through ``EngineClient``; the command around it is
``serving/cli/generate.py``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from pagedserve.controller.client import EngineClient
from pagedserve.controller.errors import EngineDeadError
from pagedserve.controller.outputs import final_output_sink
from pagedserve.messages import AddRequest, RequestOutput
from pagedserve.serving.jsonl_job.lines import (
    Item,
    LineError,
    error_record,
    id_key,
    line_id,
    parse_line,
    result_record,
)

logger = logging.getLogger(__name__)

__all__ = ["JobSummary", "LineError", "run_job"]

MAX_EXIT_STATUS = 125  # 126 and up mean "not executable" / "killed by a signal" to shells


@dataclass(slots=True)
class JobSummary:
    """What a ``run_job`` call did."""

    total: int = 0
    """Request lines in the input (blank lines are not requests)."""
    skipped: int = 0
    """Lines whose id the output file already held (done by an earlier run)."""
    succeeded: int = 0
    failed: int = 0
    """Lines written as error records by this run."""
    not_done: int = 0
    """Lines left for a rerun because the engine died or the job was interrupted."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    engine_error: str | None = None
    interrupted: bool = False
    failed_lines: list[int] = field(default_factory=list)
    """Input line numbers of the failed lines (the first 1000)."""

    @property
    def exit_status(self) -> int:
        if self.interrupted:
            return 130
        bad = self.failed + self.not_done
        return min(bad, MAX_EXIT_STATUS)

    def describe(self) -> str:
        parts = [
            f"{self.succeeded} succeeded", f"{self.failed} failed",
            f"{self.skipped} already done",
        ]
        if self.not_done:
            parts.append(f"{self.not_done} not done (rerun the same command to finish them)")
        rate = self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return (f"{self.total} requests: " + ", ".join(parts)
                + f"; {self.completion_tokens} tokens generated in {self.elapsed_s:.1f}s "
                f"({rate:.1f} tok/s)")


# ---------------------------------------------------------------------------------- the job
def _scan_output(path: str) -> set[str]:
    """Ids already written to ``path``; a truncated last record is cut off the file."""
    done: set[str] = set()
    if not os.path.exists(path):
        return done
    good_end = 0
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        end = len(data) if nl < 0 else nl + 1
        raw = data[pos:end]
        try:
            rec = json.loads(raw)
            if not isinstance(rec, dict) or "id" not in rec:
                raise ValueError("not a record")
        except ValueError:
            if nl < 0:  # the last line, cut short by a kill: drop it, its request is redone
                logger.warning("%s: dropping a truncated last record (%d bytes)", path, len(raw))
                break
            logger.warning("%s: ignoring an unreadable record at byte %d", path, pos)
        else:
            done.add(id_key(rec["id"]))
        good_end = end
        pos = end
    if good_end < len(data):
        with open(path, "r+b") as f:
            f.truncate(good_end)
    elif data and not data.endswith(b"\n"):
        with open(path, "ab") as f:  # a complete record missing only its newline
            f.write(b"\n")
    return done


def _read_lines(path: str) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, text in enumerate(f, start=1):
            if text.strip():
                yield lineno, text


def _count_lines(path: str) -> int:
    return sum(1 for _ in _read_lines(path))


class _Progress:
    """A tqdm bar on a terminal, a log line every ``log_every_s`` otherwise, or nothing."""

    def __init__(self, mode: str, total: int, client: EngineClient, log_every_s: float) -> None:
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "log"
        self.mode = mode
        self.total = total
        self.client = client
        self.log_every_s = log_every_s
        self.start = time.monotonic()
        self._last_stats = 0.0
        self._last_log = self.start
        self._kv = 0.0
        self.bar: Any = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True)

    def _kv_usage(self, now: float) -> float:
        if now - self._last_stats >= 0.5:  # a remote client's stats() may be an RPC
            self._last_stats = now
            try:
                self._kv = float(self.client.stats().get("kv_usage", 0.0))
            except Exception:
                pass
        return self._kv

    def update(self, done: int, failed: int, tokens: int, new: int, force: bool = False) -> None:
        if self.mode == "none":
            return
        now = time.monotonic()
        elapsed = max(now - self.start, 1e-9)
        if self.bar is not None:
            if new:
                self.bar.update(new)
            if new or force:
                self.bar.set_postfix(
                    tok_s=f"{tokens / elapsed:.1f}", kv=f"{self._kv_usage(now):.0%}",
                    failed=failed, refresh=False,
                )
            return
        if force or now - self._last_log >= self.log_every_s:
            self._last_log = now
            print(f"pagedserve generate: {done}/{self.total} done ({failed} failed), "
                  f"{tokens / elapsed:.1f} tok/s, kv {self._kv_usage(now):.0%}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Writer:
    def __init__(self, f: IO[str]) -> None:
        self.f = f

    def write(self, rec: dict[str, Any]) -> None:
        # One write per record, flushed at once: a kill leaves at most one partial last line.
        self.f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self.f.flush()


def nothing_left(input_path: str, output_path: str) -> JobSummary | None:
    """The summary of a rerun with nothing to do (every line's id already in the output), so
    that the caller need not start an engine; None when some line is left."""
    done_keys = _scan_output(output_path)
    summary = JobSummary()
    for lineno, text in _read_lines(input_path):
        try:
            obj: Any = json.loads(text)
        except ValueError:
            return None
        if id_key(line_id(lineno, obj)) not in done_keys:
            return None
        summary.total += 1
    summary.skipped = summary.total
    return summary


def run_job(
    client: EngineClient,
    input_path: str,
    output_path: str,
    defaults: dict[str, Any],
    *,
    max_in_flight: int = 256,
    progress: str | bool = "auto",
    log_every_s: float = 10.0,
) -> JobSummary:
    """Run every request of ``input_path`` not yet in ``output_path`` through ``client``.

    ``defaults`` are ``SamplingParams`` keyword arguments that a line's own fields override.
    ``progress``: ``auto`` | ``bar`` | ``log`` | ``none`` (True/False mean auto/none).
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    mode = {True: "auto", False: "none"}.get(progress, progress)  # type: ignore[call-overload]
    summary = JobSummary()
    start = time.monotonic()
    done_keys = _scan_output(output_path)
    summary.total = _count_lines(input_path)
    seen: dict[str, int] = {}
    finished: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
    in_flight: dict[str, Item] = {}
    bar = _Progress(mode, summary.total, client, log_every_s)
    counted = 0

    def tick(force: bool = False) -> None:
        nonlocal counted
        finished_now = summary.succeeded + summary.failed + summary.skipped
        bar.update(finished_now, summary.failed, summary.completion_tokens,
                   finished_now - counted, force)
        counted = finished_now

    def fail(writer: _Writer, lineno: int, rid: Any, exc: BaseException, meta: Any = None) -> None:
        writer.write(error_record(lineno, rid, exc, meta))
        summary.failed += 1
        if len(summary.failed_lines) < 1000:
            summary.failed_lines.append(lineno)
        tick()

    def collect(writer: _Writer, block: bool) -> None:
        """Write the outputs that have finished; with ``block``, wait for at least one."""
        while in_flight:
            try:
                out = finished.get(timeout=0.5) if block else finished.get_nowait()
            except queue.Empty:
                if block:
                    if not client.is_healthy():
                        raise EngineDeadError("the engine is no longer healthy") from None
                    tick()
                    continue
                return
            block = False
            item = in_flight.pop(out.request_id, None)
            if item is None:
                continue
            if out.error is not None:
                if not client.is_healthy():  # the engine died: leave it for a rerun
                    in_flight[out.request_id] = item
                    raise EngineDeadError(out.error)
                fail(writer, item.line, item.id, RuntimeError(out.error), item.metadata)
                continue
            rec = result_record(item, out)
            writer.write(rec)
            summary.succeeded += 1
            summary.prompt_tokens += rec["usage"]["prompt_tokens"]
            summary.completion_tokens += rec["usage"]["completion_tokens"]
            tick()

    tokenizer = client.tokenizer
    with open(output_path, "a", encoding="utf-8") as f:
        writer = _Writer(f)
        lines = _read_lines(input_path)
        try:
            for lineno, text in lines:
                try:
                    obj: Any = json.loads(text)
                except ValueError:
                    obj = None
                rid = line_id(lineno, obj)
                key = id_key(rid)
                if key in done_keys:
                    summary.skipped += 1
                    continue
                if key in seen:
                    fail(writer, lineno, rid,
                         LineError(f"duplicate id {rid!r} (first on line {seen[key]})"))
                    continue
                seen[key] = lineno
                try:
                    item = parse_line(lineno, text, defaults, tokenizer)
                except LineError as exc:
                    meta = obj.get("metadata") if isinstance(obj, dict) else None
                    fail(writer, lineno, rid, exc, meta)
                    continue
                while len(in_flight) >= max_in_flight:
                    collect(writer, block=True)
                request_id = f"job-{lineno}"
                try:
                    in_flight[request_id] = item
                    add = AddRequest(request_id, item.token_ids, item.params, item.prompt,
                                     item.cache_salt, final_only=True)
                    client.add_request(add, final_output_sink(add, finished.put))
                except EngineDeadError:
                    in_flight.pop(request_id, None)
                    raise
                except ValueError as exc:  # RequestError: too long, bad ids, too large, ...
                    in_flight.pop(request_id, None)
                    fail(writer, lineno, item.id, exc, item.metadata)
                    continue
                collect(writer, block=False)
            while in_flight:
                collect(writer, block=True)
        except EngineDeadError as exc:
            summary.engine_error = str(exc)
            summary.not_done = summary.total - summary.skipped - summary.succeeded - summary.failed
            logger.error("the engine died: %s", exc)
        except KeyboardInterrupt:
            summary.interrupted = True
            summary.not_done = summary.total - summary.skipped - summary.succeeded - summary.failed
            for request_id in in_flight:
                try:
                    client.abort_request(request_id)
                except Exception:
                    pass
        finally:
            summary.elapsed_s = time.monotonic() - start
            tick(force=True)
            bar.close()
    return summary
