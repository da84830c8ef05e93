"""The engine core: validation, the KV cache plan, and the schedule -> execute -> update step.

Synchronous and transport-free: ``controller.loop.EngineLoop`` drives it, here or in the Ray
controller actor; workers are reached through an ``Executor``. Each step returns per-step
deltas (``controller.outputs``): O(new tokens), never O(length)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Collection

from pagedserve.config import EngineConfig
from pagedserve.controller import recovery
from pagedserve.controller.admission import check_admission
from pagedserve.controller.drafts.drafter import Drafter, make_proposer
from pagedserve.controller.engine_stats import engine_stats
from pagedserve.controller.errors import DuplicateRequestError, EngineDeadError
from pagedserve.controller.executor import Executor, WorkerGroupError
from pagedserve.controller.kv_plan import plan_kv_cache, resolve_max_model_len
from pagedserve.controller.outputs import RequestGroup
from pagedserve.controller.rejected import fail_rejected
from pagedserve.controller.request import RequestStatus, request_group, sequence_ids
from pagedserve.controller.restarts import RestartPolicy
from pagedserve.controller.resume import resume_group
from pagedserve.controller.scheduler import Scheduler, StepHook
from pagedserve.controller.structured_output import GrammarGate, admit_compiled, grammar_text
from pagedserve.controller.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
from pagedserve.kv import BlockHasher
from pagedserve.messages import AddRequest, ModelRunnerOutput, RequestDelta, SchedulerOutput

__all__ = ["EngineCore"]

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler and KV manager; drives one executor.

    Construction talks to the workers: load the model, plan the KV pool from their report, and
    ask them to allocate it. ``eos_token_ids`` overrides the tokenizer's. A worker-group failure
    preempts the in-flight requests by recompute and rebuilds the group after ``restarts``'
    backoff, after which they carry on; once the policy gives up the engine is dead (its
    requests fail, ``healthy`` is False, a later ``step`` raises ``EngineDeadError``).
    """

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        *,
        tokenizer: Tokenizer | None = None,
        eos_token_ids: Collection[int] | None = None,
        restarts: RestartPolicy | None = None,
    ) -> None:
        self.config = config
        self.executor = executor
        self.restarts = restarts or RestartPolicy()
        self.last_failure: BaseException | None = None
        self.num_restarts = 0
        self._restart_at: float | None = None  # set while the group awaits its rebuild
        self._dead: str | None = None
        self._group_failure = ""  # the last worker-group failure, for a failed rebuild's reason
        report = executor.initialize()
        self.worker_report = report
        self.vocab_size = report.vocab_size
        self.max_model_len = resolve_max_model_len(config, report)
        self.kv_plan = plan_kv_cache(config, report, self.max_model_len)
        self.kv_layout = self.kv_plan.layout
        self.kv = self.kv_plan.new_manager()
        executor.init_kv_cache(self.kv_layout)
        self.hasher = BlockHasher(self.kv.block_size)
        if tokenizer is None:
            tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else ()
        self._eos_token_ids = tuple(eos_token_ids)
        self.scheduler = self._new_scheduler([])
        self._groups: dict[str, RequestGroup] = {}
        self._time_schedule = 0.0
        self._time_execute = 0.0
        self._time_grammar_mask = 0.0  # inside _time_schedule: the masks of constrained requests
        self._num_grammar_mask_steps = 0
        self._kv_integrity_ok = 1
        self._kv_checks = 0
        self._grammars: GrammarGate | None = None  # made by the first constrained request
        # Steps handed to the executor and not yet taken in, oldest first, with the output if
        # the executor ran it at once. Two at most (async scheduling, ``_may_overlap``).
        self._in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput | None]] = deque()
        self._num_overlapped = 0
        overlaps = getattr(executor, "overlaps_steps", False)  # see ``Executor``
        self._overlap = config.scheduler.async_scheduling and overlaps
        spec = config.speculative
        self.drafter = None if spec.method is None else Drafter(
            make_proposer(spec), spec.num_speculative_tokens, spec.disable_by_batch_size,
            self.max_model_len)

    def _new_scheduler(self, step_hooks: list[StepHook]) -> Scheduler:
        sched = self.config.scheduler
        scheduler = Scheduler(
            self.kv,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_num_seqs=sched.max_num_seqs,
            max_model_len=self.max_model_len,
            eos_token_ids=self._eos_token_ids,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            preemption_mode=sched.preemption_mode,
            policy=sched.scheduling_policy,
            num_scheduler_steps=1 if self.config.speculative.method else sched.num_scheduler_steps,
        )
        scheduler.step_hooks = step_hooks
        return scheduler

    # ----------------------------------------------------------------- requests
    def add_request(self, req: AddRequest, arrival_time: float | None = None) -> None:
        """Validate and queue a request. Raises a ``RequestError`` subclass, with nothing
        changed, for a duplicate id, an empty, too long or out-of-vocabulary prompt, or a
        request the KV cache could never hold."""
        rid, params = req.request_id, req.params
        ids = list(req.prompt_token_ids)
        if rid in self._groups or any(
            i in self.scheduler.requests for i in sequence_ids(rid, params.n)
        ):
            raise DuplicateRequestError(f"request id {rid!r} is already in use")
        check_admission(ids, params, vocab_size=self.vocab_size,
                        max_model_len=self.max_model_len, has_tokenizer=self.tokenizer is not None,
                        max_num_seqs=self.scheduler.max_num_seqs, kv=self.kv,
                        priority=req.priority, policy=self.scheduler.policy)
        spec = params.structured_outputs
        grammar = None if spec is None else grammar_text(spec)
        tok = self.tokenizer
        detokenizer = None if tok is None else (
            lambda p: IncrementalDetokenizer(tok, ids, p.skip_special_tokens)
        )
        head, seqs = request_group(rid, ids, params, detokenizer, hasher=self.hasher,
                                   cache_salt=req.cache_salt, arrival_time=arrival_time,
                                   priority=req.priority)
        group = RequestGroup(rid, seqs, head if params.n > 1 else None, req.final_only)
        if req.resume is not None:  # moved here from a controller that died
            resume_group(group, head, req.resume, self.vocab_size, self.scheduler)
        self._groups[rid] = group
        if grammar is None:
            self.scheduler.add_request(head)
            return
        if self._grammars is None:
            assert tok is not None  # admission refused a constraint without a tokenizer
            self._grammars = GrammarGate(tok, self.vocab_size, self._eos_token_ids,
                                         self.max_model_len)
        self._grammars.hold(head, seqs, grammar)

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """Abort wherever the request is and free its blocks. Returns its final delta
        (unfinished completions end with ``finish_reason="abort"``), or None for an unknown or
        finished id."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        if self._grammars is not None:
            self._grammars.drop(request_id)
        self.scheduler.finish_requests(group.seq_ids(), RequestStatus.FINISHED_ABORTED)
        return group.delta()

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestDelta]:
        """Schedule, execute and update once (with async scheduling: schedule and submit the
        next step, then take in the one before). Returns a delta for every request that got
        a token or finished. When the worker group fails, the requests in flight go back to
        the waiting queue (no delta) and the group is rebuilt by a later call, after the
        backoff. A request that ran through more than ``max_failures_per_request`` failures
        ends with an ``error`` delta (``RequestFailedError``) naming the rank and node; once
        the restart policy gives up every request does (``EngineDeadError``), and later
        calls raise ``EngineDeadError``.
        """
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._restart_at is None:
            failure = self.executor.check_failure()
            if failure is not None:
                return self._on_worker_failure(failure)  # found by the monitor between steps
        elif not self._restart():
            # Still waiting for the group, or dead now: then every request ends here.
            return self._fail_all(self._dead) if self._dead is not None else []
        deltas = [] if self._grammars is None else admit_compiled(
            self._grammars, self._groups, self.scheduler
        )
        try:
            if not self._in_flight:
                if not self.scheduler.has_unfinished():
                    return deltas
                preemptions = self.scheduler.num_preemptions
                if not self._submit_next():
                    # A step that preempted admits nothing by design; the next one will.
                    if self.scheduler.num_preemptions != preemptions:
                        return deltas
                    return deltas + recovery.fail_unschedulable(self.scheduler, self._groups)
            if self._may_overlap() and self._submit_next():
                self._num_overlapped += 1  # runs while the controller takes in the one before
            deltas += self._finish_oldest()
            if self._in_flight and not self.scheduler.has_unfinished():
                deltas += self._finish_oldest()  # its requests all ended: nothing to wait for
        except WorkerGroupError as exc:
            return deltas + self._on_worker_failure(exc)
        return deltas

    def _submit_next(self) -> bool:
        """Schedule a step and hand it to the executor; False when it schedules nothing."""
        t0 = time.perf_counter()
        if self.drafter is not None:
            self.scheduler.num_lookahead_tokens = self.drafter.propose(self.scheduler.running)
        sched_out = self.scheduler.schedule()
        if self._grammars is not None:
            tm = time.perf_counter()
            sched_out.token_masks = self._grammars.step_masks(self.scheduler.requests, sched_out)
            if sched_out.token_masks:  # what a constraint costs each step, on the step's path
                self._time_grammar_mask += time.perf_counter() - tm
                self._num_grammar_mask_steps += 1
        t1 = time.perf_counter()
        self._time_schedule += t1 - t0
        if sched_out.total_num_scheduled_tokens == 0:
            return False
        if self._overlap:
            self.executor.submit(sched_out)  # type: ignore[attr-defined]
            self._in_flight.append((sched_out, None))
        else:
            self._in_flight.append((sched_out, self.executor.execute(sched_out)))
        self._time_execute += time.perf_counter() - t1
        return True

    def _may_overlap(self) -> bool:
        """Schedule the next step before the one in flight is back (async scheduling)?

        Not when a step depends on what the one in flight samples beyond its token:
        speculative drafts and grammar masks follow from the accepted tokens. Not behind a step
        that adds requests either (a worker may refuse one, ``fail_rejected``, and the next
        step would name it as running), nor behind several decode passes."""
        if not self._overlap or len(self._in_flight) != 1 or self.drafter is not None:
            return False
        last = self._in_flight[0][0]
        return not last.new_reqs and last.num_decode_steps == 1 and all(
            r.grammar is None for r in self.scheduler.running)

    def _finish_oldest(self) -> list[RequestDelta]:
        """Take in the oldest step's output: append its tokens, apply the stop conditions and
        return the deltas of the requests that progressed."""
        sched_out, runner_out = self._in_flight.popleft()
        if runner_out is None:
            t = time.perf_counter()
            runner_out = self.executor.collect()  # type: ignore[attr-defined]
            self._time_execute += time.perf_counter() - t
        t2 = time.perf_counter()
        deltas: list[RequestDelta] = []
        if runner_out.request_errors:
            deltas += fail_rejected(self.scheduler, self._groups, sched_out,
                                    runner_out.request_errors)
        progressed = self.scheduler.update_from_output(sched_out, runner_out)
        if self.drafter is not None:
            self.drafter.record(sched_out, runner_out, self.scheduler.requests)
            self.drafter.release_finished(self.scheduler.requests)
        for gid in dict.fromkeys(r.group_id for r in progressed):  # each group once, in order
            group = self._groups.get(gid)
            if group is None:
                continue
            delta = group.delta()
            if delta is not None:
                deltas.append(delta)
            if group.finished:
                del self._groups[gid]
        # The controller's share of a step (schedule + bookkeeping) against the workers'.
        self._time_schedule += time.perf_counter() - t2
        return deltas

    # ------------------------------------------------------------------- faults
    @property
    def healthy(self) -> bool:
        """False once worker-group restarts are exhausted (the engine is dead)."""
        return self._dead is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def _on_worker_failure(self, exc: WorkerGroupError) -> list[RequestDelta]:
        """Preempt every live request by recompute into a fresh scheduler and KV manager and
        schedule the group's rebuild (``controller.recovery``): the streams stay open and emit
        nothing now. Returns the final deltas of the requests that fail instead: those run
        through more than ``max_failures_per_request`` failures, or all of them once the
        restart policy gives up (the engine is dead)."""
        self.last_failure = exc
        self._group_failure = reason = str(exc)
        self._in_flight.clear()  # the group's steps never answer now
        self._schedule_restart(reason)
        if self._dead is not None:
            return self._fail_all(self._dead)
        old = self.scheduler
        heads = recovery.live_heads(old)
        recovery.count_failure(old)
        deltas = recovery.fail_over_limit(heads, self._groups,
                                          self.restarts.max_failures_per_request, reason)
        # The workers' rows and KV blocks (both tiers) are gone with them: nothing may refer
        # to a block of the dead group, so the requests start over in a fresh manager.
        self.kv = self.kv_plan.new_manager()
        self.scheduler = self._new_scheduler(old.step_hooks)
        recovery.resume([h for h in heads if not h.is_finished], self.scheduler)
        return deltas

    def _fail_all(self, reason: str) -> list[RequestDelta]:
        """The engine is dead: end every request (held grammars included) with an
        ``EngineDeadError`` delta and release every block of both tiers."""
        deltas = recovery.fail_all(self._groups, reason)
        self._in_flight.clear()
        if self._grammars is not None:
            self._grammars.clear()
        self.kv = self.kv_plan.new_manager()
        self.scheduler = self._new_scheduler(self.scheduler.step_hooks)
        return deltas

    def _schedule_restart(self, reason: str) -> None:
        delay = self.restarts.on_failure()
        if delay is None:
            self._dead = (
                f"worker group failed {self.restarts.recent_failures} times within "
                f"{self.restarts.window_s:.0f} s (at most {self.restarts.max_restarts} "
                f"restarts); last failure: {reason}"
            )
            logger.error("engine is dead: %s", self._dead)
            self._restart_at = None
            self.executor.shutdown()
            return
        self._restart_at = time.monotonic() + delay
        logger.warning("%s; rebuilding the worker group in %.1f s", reason, delay)

    def _restart(self) -> bool:
        """Rebuild the worker group once the backoff has passed (waiting for it, bounded by
        the policy's longest backoff). True when the group is back."""
        assert self._restart_at is not None
        wait = min(self._restart_at - time.monotonic(), self.restarts.backoff_max_s)
        time.sleep(max(0.0, wait))
        try:
            report = self.executor.restart()
            if report.vocab_size != self.vocab_size:
                raise RuntimeError(f"rebuilt workers report vocab {report.vocab_size}")
        except Exception as exc:
            self.last_failure = exc
            self._schedule_restart(f"restart failed: {exc} (after {self._group_failure})")
            return False
        self._restart_at = None
        self.num_restarts += 1
        logger.warning("worker group rebuilt (restart %d)", self.num_restarts)
        return True

    # -------------------------------------------------------------------- misc
    def check_idle_kv(self) -> None:
        """With nothing in flight every block must be back: check the KV manager's invariants
        and publish the verdict in the stats. O(blocks): the loop calls it once per idle spell,
        when no command waits, never from a step."""
        if self._groups:
            return
        self._kv_checks += 1
        try:
            self.kv.check_integrity()
            host = self.kv.host
            self._kv_integrity_ok = int(
                self.kv.num_free_blocks == self.kv_layout.num_blocks - 1
                and (host is None or host.num_free_blocks == host.num_usable_blocks)
            )
        except AssertionError as exc:
            logger.error("KV manager integrity check failed while idle: %s", exc)
            self._kv_integrity_ok = 0

    def has_unfinished(self) -> bool:  # requests live, or a step still to take in
        return bool(self._groups) or bool(self._in_flight)

    def stats(self) -> dict[str, int | float]:
        """Running/waiting counts, KV usage of both tiers, prefix-cache queries and hits per
        tier (tokens), preemptions and swaps, timings; see ``engine_stats``."""
        return engine_stats(self.scheduler.stats(), self.kv, self.kv_layout.num_blocks, {
            "time_schedule_s": self._time_schedule, "time_execute_s": self._time_execute,
            "time_grammar_mask_s": self._time_grammar_mask,
            "num_grammar_mask_steps": self._num_grammar_mask_steps,
            "num_overlapped_steps": self._num_overlapped,
            # Each one a worker-group failure that the in-flight requests were carried over.
            "num_worker_restarts": self.num_restarts,
            # As of the last idle check.
            "kv_integrity_ok": self._kv_integrity_ok, "kv_integrity_checks": self._kv_checks,
            **self.kv_plan.pool_bytes(),
            **(self.drafter.stats() if self.drafter is not None else {}),
        })

    def add_step_hook(self, hook: StepHook) -> None:
        """Run ``hook(scheduler, scheduler_output)`` after every schedule, e.g. to record
        ``scheduler.kv.block_fill_snapshot()``."""
        self.scheduler.step_hooks.append(hook)

    def shutdown(self) -> None:
        if self._grammars is not None:
            self._grammars.shutdown()
        self.executor.shutdown()
