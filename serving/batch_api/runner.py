"""Runs the Batch API's batches, line by line, through the HTTP endpoints' own code.

A line's body is validated and answered by the same functions as ``/v1/completions``,
``/v1/chat/completions`` and ``/v1/responses`` (``batch_api.endpoints``),
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
{code, message}``) and the batch goes on. So does a line whose handling fails in a way nobody
foresaw: a ``server_error`` record (the exception goes to the log), and the next line. A batch
whose own handling fails (its file vanished, a bug) is marked ``failed`` and the others go on.
The runner lives on a ``LoopThread`` (its own thread and event loop, started again with a
back-off if the loop itself dies; ``alive`` False once it gave up, which ``/health`` reports).
When the engine is down, a line in flight is not written (the batch stays ``in_progress``) and
a restarted server redoes it: on start, every active batch resumes, skipping the lines whose
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

from pagedserve.serving.batch_api.endpoints import answer_line
from pagedserve.serving.batch_api.records import LineTracker, input_lines, parse_line, record
from pagedserve.serving.batch_api.store import BatchStore, RecordFile, batch_progress
from pagedserve.serving.batch_api.supervisor import LoopThread
from pagedserve.serving.openai.api_errors import APIError
from pagedserve.serving.openai.engine_run import ServerContext

__all__ = ["MAX_LINES", "BatchRunner"]

logger = logging.getLogger(__name__)

MAX_LINES = 50_000
_PERSIST_EVERY_S = 1.0


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
        poll_s: float = 0.05, restart_backoff_s: float = 1.0, max_restarts: int = 5,
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
        self._wake: asyncio.Event | None = None
        self._ready = threading.Event()
        self.worker = LoopThread("pagedserve-batches", self._run,
                                 backoff_s=restart_backoff_s, max_restarts=max_restarts)
        ctx.interactive.on_idle(self.notify)

    # ------------------------------------------------------------------ other threads
    def start(self) -> None:
        self.worker.start()
        self._ready.wait(timeout=30)

    @property
    def alive(self) -> bool:
        """False once the runner died more often than it may restart (``/health`` says)."""
        return self.worker.alive

    def notify(self) -> None:
        """Wake the runner (a new batch, a cancel, interactive traffic ended)."""
        wake = self._wake
        if wake is not None:
            self.worker.call_soon(wake.set)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop: lines in flight are aborted and not written (a restart redoes them)."""
        self.worker.stop(timeout_s)

    # ---------------------------------------------------------------- runner thread
    async def _run(self) -> None:
        # A fresh start (the first, or after the last run died): as a new server would.
        self._jobs, self._done, self._closing, self.in_flight = {}, set(), False, 0
        self._wake = asyncio.Event()
        self._ready.set()
        try:
            while True:
                self._check_cancels()
                batch_id = next(
                    (b for b in self.store.active_batches() if b not in self._done), None
                )
                if batch_id is None:
                    await self._sleep(1.0)
                    continue
                try:
                    await self._advance(batch_id)
                except Exception as exc:
                    self._abandon(batch_id, exc)
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

    def _fail(self, batch_id: str, code: str, message: str,
              from_statuses: frozenset[str] = frozenset({"validating"})) -> bool:
        errors = {"object": "list",
                  "data": [{"code": code, "message": message, "param": None, "line": None}]}
        self.store.transition(batch_id, from_statuses, "failed", errors=errors)
        return False

    def _abandon(self, batch_id: str, exc: Exception) -> None:
        """A batch whose own handling raised: fail it (the log has why), keep the others."""
        logger.error("batch %s failed in the runner", batch_id, exc_info=exc)
        self._done.add(batch_id)
        job = self._jobs.pop(batch_id, None)
        if job is not None:
            for task in job.tasks:
                task.cancel()
            job.out.close()
            job.err.close()
        try:
            self._fail(batch_id, "server_error",
                       f"the server failed while running this batch ({type(exc).__name__})",
                       frozenset({"validating", "in_progress", "finalizing"}))
        except Exception:
            logger.exception("batch %s: cannot record its failure", batch_id)

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
            try:
                line = parse_line(lineno, text, job.endpoint)
                if tracker.already_done(lineno, line):
                    continue
            except Exception as exc:  # a line nobody foresaw: its own error, not the batch's
                self._line_failed(job, None, exc)
                continue
            cid = line.custom_id
            if line.error is not None:
                code, message = line.error
                self._emit(job, job.err, record(cid, None, {"code": code, "message": message}))
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
            resp = await answer_line(self.ctx, job.endpoint, body)
        except APIError as exc:
            if exc.status == 503:  # the engine is down: leave the line for a restart
                job.missing += 1
                return
            response = {"status_code": exc.status, "request_id": f"batch_{uuid.uuid4().hex}",
                        "body": exc.body()}
            error = {"code": exc.code or exc.type, "message": exc.message}
            self._emit(job, job.err, record(custom_id, response, error))
        except Exception as exc:
            self._line_failed(job, custom_id, exc)
        else:
            response = {"status_code": 200, "request_id": resp["id"], "body": resp}
            self._emit(job, job.out, record(custom_id, response, None))

    def _line_failed(self, job: _Job, custom_id: str | None, exc: BaseException) -> None:
        """The record of a line whose handling raised: ``server_error``, as OpenAI writes it;
        the exception goes to the log, not to the file."""
        logger.error("batch %s: line %r failed", job.id, custom_id, exc_info=exc)
        err = APIError(500, "internal server error", type="server_error")
        response = {"status_code": 500, "request_id": f"batch_{uuid.uuid4().hex}",
                    "body": err.body()}
        self._emit(job, job.err, record(custom_id, response,
                                         {"code": "server_error", "message": err.message}),
                   fallback=False)

    def _emit(self, job: _Job, records: RecordFile, rec: dict[str, Any],
              fallback: bool = True) -> None:
        """Write one line's record; when that fails, its ``server_error`` record instead,
        and when even that fails (the disk), leave the line for a restart to redo."""
        try:
            self._write(job, records, rec)
        except Exception as exc:
            if fallback:
                self._line_failed(job, rec.get("custom_id"), exc)
            else:
                logger.error("batch %s: cannot write a record", job.id, exc_info=exc)
                job.missing += 1

    def _line_done(self, job: _Job, task: asyncio.Task[None]) -> None:
        """A line left the engine (answered, failed or cancelled, even before it started)."""
        self.in_flight -= 1
        job.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("batch %s: a line's task failed", job.id, exc_info=task.exception())
            job.missing += 1
        if self._wake is not None:
            self._wake.set()
        self._maybe_finish(job)

    def _write(self, job: _Job, records: RecordFile, rec: dict[str, Any]) -> None:
        records.append(rec)  # raises when the record is not written
        now = time.monotonic()
        persist = now - job.last_persist >= _PERSIST_EVERY_S  # counts are re-read on resume
        if persist:
            job.last_persist = now
        try:
            self.store.update(job.id, persist=persist, **self._progress(job))
        except Exception:  # the record is written: the counts follow at the next save
            logger.exception("batch %s: cannot save its progress", job.id)

    def _progress(self, job: _Job) -> dict[str, Any]:
        return batch_progress(self._batch(job.id)["request_counts"]["total"], job.out, job.err)

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
