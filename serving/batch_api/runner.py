"""Runs the Batch API's batches, line by line, through the HTTP endpoints' own code.

A line's body is validated and answered by the same functions as ``/v1/completions`` and
``/v1/chat/completions`` (``prepare_completion`` / ``prepare_chat``, ``Endpoint.respond``),
so a line's response body is what the endpoint would have answered, and a body the endpoint
rejects gets the endpoint's error (with its status) in the error file.

**Batch work runs behind interactive traffic.** The runner adds a line to the engine only when

1. fewer than ``max_in_flight`` (default 4) batch lines are in the engine,
2. no interactive call (``/v1/completions``, ``/v1/chat/completions``) is in progress on this
   server (``ServerContext.interactive``), and
3. the engine reports no waiting request (``stats()["num_waiting"] == 0``: nothing, from this
   server or another front end of the engine, is queued for admission).

Lines already in the engine run to their end. So an interactive request shares the engine with
at most ``max_in_flight`` batch lines, and no new line starts until it is answered (but the one
the runner had already let in as it arrived). The priority is strict: under unbroken
interactive load a batch waits.

Malformed lines (bad JSON, no ``custom_id``, a repeated ``custom_id``, a wrong ``method`` or
``url``, a body that is not an object) get an error record (``response: null``, ``error:
{code, message}``) and the batch goes on. The runner lives on a thread of its own with its own
event loop, so it starts and resumes whether or not the ASGI server runs lifespan events. When
the engine is down, a line in flight is not written (the batch stays ``in_progress``) and a
restarted server redoes it: on start, every active batch resumes, skipping the lines whose
records are already in its output or error file.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from pydantic import ValidationError

from pagedserve.serving.batch_api.records import LineTracker, input_lines, parse_line, record
from pagedserve.serving.batch_api.store import BatchStore, RecordFile
from pagedserve.serving.openai.engine_run import APIError, ServerContext, validation_error
from pagedserve.serving.openai.prepare import prepare_chat, prepare_completion
from pagedserve.serving.openai.protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["ENDPOINTS", "MAX_LINES", "BatchRunner"]

logger = logging.getLogger(__name__)

ENDPOINTS: dict[str, Any] = {
    "/v1/completions": (CompletionRequest, prepare_completion),
    "/v1/chat/completions": (ChatCompletionRequest, prepare_chat),
}
MAX_LINES = 50_000
_PERSIST_EVERY_S = 1.0


async def _never() -> bool:
    return False


@dataclass
class _Job:
    """A batch this runner has opened: its record files and its lines in the engine."""

    id: str
    endpoint: str
    out: RecordFile
    err: RecordFile
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    scanned: bool = False
    missing: int = 0
    """Lines the engine could not answer because it was down (redone after a restart)."""
    last_persist: float = 0.0


class BatchRunner:
    """Executes the active batches of ``store`` on ``ctx``'s engine, oldest first."""

    def __init__(
        self, store: BatchStore, ctx: ServerContext, *, max_in_flight: int = 4,
        poll_s: float = 0.05,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.store = store
        self.ctx = ctx
        self.max_in_flight = max_in_flight
        self.poll_s = poll_s
        self.in_flight = 0
        self.submitted = 0
        """Lines handed to the engine since start (tests and metrics read it)."""
        self.held_back = 0
        """Times the rule kept the next line waiting."""
        self._jobs: dict[str, _Job] = {}
        self._done: set[str] = set()  # batches whose lines were all handed out in this run
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name="pagedserve-batches",
                                        daemon=True)
        ctx.interactive.on_idle(self.notify)

    # ------------------------------------------------------------------ other threads
    def start(self) -> None:
        self._thread.start()
        self._ready.wait(timeout=30)

    def notify(self) -> None:
        """Wake the runner (a new batch, a cancel, interactive traffic ended)."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # closing
                pass

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop: lines in flight are aborted and not written (a restart redoes them)."""
        loop, main = self._loop, self._main
        if loop is not None and main is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(main.cancel)
            except RuntimeError:
                pass
        self._thread.join(timeout=timeout_s)

    # ---------------------------------------------------------------- runner thread
    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._run())
        finally:
            loop.close()

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._main = asyncio.current_task()
        self._ready.set()
        try:
            while True:
                self._check_cancels()
                batch_id = next(
                    (b for b in self.store.active_batches() if b not in self._done), None
                )
                if batch_id is None:
                    await self._sleep(1.0)
                else:
                    await self._advance(batch_id)
        except asyncio.CancelledError:
            pass
        finally:
            self._closing = True  # what is cancelled now is redone by the next start
            for job in list(self._jobs.values()):
                for task in job.tasks:
                    task.cancel()
                await asyncio.gather(*job.tasks, return_exceptions=True)
                job.out.close()
                job.err.close()

    async def _sleep(self, timeout: float) -> None:
        assert self._wake is not None
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        self._wake.clear()
        self._check_cancels()

    async def _advance(self, batch_id: str) -> None:
        batch = self._batch(batch_id)
        if batch["status"] == "validating" and not self._validate(batch):
            self._done.add(batch_id)
            return
        job = self._open(batch_id)
        if self._batch(batch_id)["status"] == "in_progress":
            await self._scan(job)
        job.scanned = True
        self._done.add(batch_id)
        self._maybe_finish(job)

    def _validate(self, batch: dict[str, Any]) -> bool:
        path = self.store.content_path(batch["input_file_id"])
        try:
            total = sum(1 for _ in input_lines(path))
        except OSError as exc:
            return self._fail(batch["id"], "invalid_file", f"cannot read the input file: {exc}")
        if total == 0:
            return self._fail(batch["id"], "empty_file", "the input file has no request lines")
        if total > MAX_LINES:
            return self._fail(batch["id"], "too_many_requests",
                              f"the input file has {total} lines; at most {MAX_LINES} are allowed")
        counts = {"total": total, "completed": 0, "failed": 0}
        self.store.transition(batch["id"], {"validating"}, "in_progress", request_counts=counts)
        return True

    def _fail(self, batch_id: str, code: str, message: str) -> bool:
        errors = {"object": "list",
                  "data": [{"code": code, "message": message, "param": None, "line": None}]}
        self.store.transition(batch_id, {"validating"}, "failed", errors=errors)
        return False

    def _open(self, batch_id: str) -> _Job:
        state = self.store.state(batch_id)
        out = RecordFile(self.store.content_path(state["output_file_id"]))
        err = RecordFile(self.store.content_path(state["error_file_id"]))
        job = self._jobs[batch_id] = _Job(batch_id, self._batch(batch_id)["endpoint"], out, err)
        self.store.update(batch_id, **self._progress(job))
        return job

    async def _scan(self, job: _Job) -> None:
        """Hand every line not yet done to the engine, in file order, under the rule."""
        tracker = LineTracker(job.out.keys + job.err.keys)
        path = self.store.content_path(self._batch(job.id)["input_file_id"])
        for lineno, text in input_lines(path):
            if self._cancelling(job.id):
                return
            line = parse_line(lineno, text, job.endpoint)
            cid = line.custom_id
            if tracker.already_done(lineno, line):
                continue
            if line.error is not None:
                code, message = line.error
                self._write(job, job.err, record(cid, None, {"code": code, "message": message}))
                await asyncio.sleep(0)
                continue
            if not await self._slot(job):
                return
            task = asyncio.create_task(self._serve(job, cid, line.body or {}))
            job.tasks.add(task)
            task.add_done_callback(partial(self._line_done, job))

    def _quiet(self) -> bool:
        """The rule's conditions 2 and 3: no interactive call, nothing waiting in the engine."""
        if self.ctx.interactive.count > 0:
            return False
        client = self.ctx.client
        try:
            return client.is_healthy() and not client.stats().get("num_waiting", 0)
        except Exception:
            return False

    async def _slot(self, job: _Job) -> bool:
        """Wait until the rule lets one more line into the engine; False if cancelled."""
        while True:
            if self._cancelling(job.id):
                return False
            if self.in_flight < self.max_in_flight and self._quiet():
                self.in_flight += 1
                self.submitted += 1
                return True
            self.held_back += 1
            await self._sleep(self.poll_s)

    async def _serve(self, job: _Job, custom_id: str | None, body: dict[str, Any]) -> None:
        try:
            resp = await self._respond(job.endpoint, body)
        except APIError as exc:
            if exc.status == 503:  # the engine is down: leave the line for a restart
                job.missing += 1
                return
            response = {"status_code": exc.status, "request_id": f"batch_{uuid.uuid4().hex}",
                        "body": exc.body()}
            error = {"code": exc.code or exc.type, "message": exc.message}
            self._write(job, job.err, record(custom_id, response, error))
        except Exception as exc:
            logger.exception("batch %s: line %s failed", job.id, custom_id)
            err = APIError(500, f"internal server error: {exc!r}", type="server_error")
            response = {"status_code": 500, "request_id": f"batch_{uuid.uuid4().hex}",
                        "body": err.body()}
            self._write(job, job.err, record(custom_id, response,
                                              {"code": "server_error", "message": err.message}))
        else:
            response = {"status_code": 200, "request_id": resp["id"], "body": resp}
            self._write(job, job.out, record(custom_id, response, None))

    def _line_done(self, job: _Job, task: asyncio.Task[None]) -> None:
        """A line left the engine (answered, failed or cancelled, even before it started)."""
        self.in_flight -= 1
        job.tasks.discard(task)
        if self._wake is not None:
            self._wake.set()
        self._maybe_finish(job)

    async def _respond(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        """What the endpoint answers to ``body``; raises its ``APIError``."""
        model, prepare = ENDPOINTS[endpoint]
        if body.get("stream"):
            raise APIError(400, "stream is not supported in a batch", param="stream")
        try:
            request = model.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None
        answer = await prepare(self.ctx, request)
        try:
            result: dict[str, Any] = await answer.respond(_never)
            return result
        finally:
            answer.run.abort()

    def _write(self, job: _Job, records: RecordFile, rec: dict[str, Any]) -> None:
        records.append(rec)
        now = time.monotonic()
        persist = now - job.last_persist >= _PERSIST_EVERY_S  # counts are re-read on resume
        if persist:
            job.last_persist = now
        self.store.update(job.id, persist=persist, **self._progress(job))

    def _progress(self, job: _Job) -> dict[str, Any]:
        """``request_counts`` and ``usage`` of the Batch object, from the record files."""
        total = self._batch(job.id)["request_counts"]["total"]
        u = job.out.usage
        return {
            "request_counts": {"total": total, "completed": job.out.count,
                               "failed": job.err.count},
            "usage": {
                "input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": u["cached_tokens"]},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            },
        }

    def _batch(self, batch_id: str) -> dict[str, Any]:
        batch = self.store.get_batch(batch_id)
        assert batch is not None, batch_id
        return batch

    # --------------------------------------------------------------- cancel and finish
    def _cancelling(self, batch_id: str) -> bool:
        batch = self.store.get_batch(batch_id)
        return batch is None or batch["status"] == "cancelling"

    def _check_cancels(self) -> None:
        for job in list(self._jobs.values()):
            if self._cancelling(job.id):
                for task in job.tasks:
                    task.cancel()
                self._maybe_finish(job)

    def _maybe_finish(self, job: _Job) -> None:
        if self._closing or not job.scanned or job.tasks or job.id not in self._jobs:
            return
        if self._cancelling(job.id):
            self._register(job)
            self.store.transition(job.id, {"cancelling"}, "cancelled", **self._file_ids(job))
        elif job.missing:
            return  # the engine went down: a restarted server finishes this batch
        elif self.store.transition(job.id, {"in_progress", "finalizing"}, "finalizing"):
            self._register(job)
            self.store.transition(job.id, {"finalizing"}, "completed", **self._file_ids(job))
        else:
            return
        del self._jobs[job.id]
        for records in (job.out, job.err):
            records.close()
            if not records.count:  # not registered as a file: leave nothing behind
                records.path.unlink(missing_ok=True)

    def _file_ids(self, job: _Job) -> dict[str, Any]:
        state = self.store.state(job.id)
        return {
            "output_file_id": state["output_file_id"] if job.out.count else None,
            "error_file_id": state["error_file_id"] if job.err.count else None,
        }

    def _register(self, job: _Job) -> None:
        state = self.store.state(job.id)
        for records, kind in ((job.out, "output"), (job.err, "error")):
            if records.count:
                self.store.add_file(None, f"{job.id}_{kind}.jsonl", "batch_output",
                                    file_id=state[f"{kind}_file_id"])
        self.store.update(job.id, **self._progress(job))
