"""The engine core: validation, the KV cache plan, and the schedule -> execute -> update loop.

It is synchronous and transport-free: the ``LLM`` class drives it in-process, and the Ray
controller actor wraps it. Workers are reached only through an ``Executor``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection, Sequence

from pagedserve.config import EngineConfig
from pagedserve.controller.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    InvalidTokenError,
    PromptTooLongError,
    RequestTooLargeError,
    UnsupportedRequestError,
)
from pagedserve.controller.executor import Executor, WorkerGroupError
from pagedserve.controller.request import Request, RequestStatus
from pagedserve.controller.scheduler import Scheduler, StepHook
from pagedserve.controller.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
from pagedserve.kv import (
    BlockHasher,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheManager,
    KVCacheSpec,
    SlidingWindowSpec,
    group_layer_specs,
    num_blocks_from_bytes,
)
from pagedserve.kv.errors import RequestTooLargeError as KVRequestTooLargeError
from pagedserve.messages import (
    CompletionOutput,
    KVCacheLayout,
    RequestOutput,
    SamplingParams,
    WorkerReport,
)

__all__ = ["EngineCore", "child_seed", "kv_groups_from_report", "resolve_max_model_len"]

logger = logging.getLogger(__name__)

_SEED_STRIDE = 1_000_003  # a prime, so children of nearby seeds do not collide


def child_seed(seed: int | None, index: int) -> int | None:
    """Seed of completion ``index``: completion 0 keeps the user's seed, so ``n=1`` and ``n>1``
    agree on it; the others get a deterministic, distinct derivation."""
    if seed is None or index == 0:
        return seed
    return (seed + index * _SEED_STRIDE) % 2**63


def resolve_max_model_len(config: EngineConfig, report: WorkerReport) -> int:
    """The configured limit, else the checkpoint's; never more than the checkpoint supports."""
    configured = config.model.max_model_len
    if configured is None:
        return report.max_model_len
    if configured > report.max_model_len:
        logger.warning(
            "max_model_len=%d exceeds the model's %d; using %d",
            configured,
            report.max_model_len,
            report.max_model_len,
        )
        return report.max_model_len
    return configured


def kv_groups_from_report(report: WorkerReport, block_size: int) -> list[KVCacheGroup]:
    """Per-layer KV specs (layer index as name, in model order) grouped by kv's rules."""
    specs: dict[str, KVCacheSpec] = {}
    for i, ls in enumerate(report.layer_specs):
        if ls.sliding_window is not None:
            specs[str(i)] = SlidingWindowSpec(
                block_size, ls.num_kv_heads, ls.head_size, ls.dtype_bytes, ls.sliding_window
            )
        else:
            specs[str(i)] = FullAttentionSpec(
                block_size, ls.num_kv_heads, ls.head_size, ls.dtype_bytes
            )
    return group_layer_specs(specs)


@dataclasses.dataclass(slots=True)
class _Group:
    """One user request: its ``n`` completion sequences (and the fork parent, until it forks)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request]
    parent: Request | None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class EngineCore:
    """Owns the scheduler and KV manager; drives one executor.

    Construction talks to the workers: load the model, plan the KV pool from their report, and
    ask them to allocate it. ``eos_token_ids`` overrides the tokenizer's.
    """

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        *,
        tokenizer: Tokenizer | None = None,
        eos_token_ids: Collection[int] | None = None,
        max_restarts: int = 3,
        restart_window_s: float = 600.0,
        restart_backoff_s: float = 1.0,
        restart_backoff_max_s: float = 30.0,
    ) -> None:
        """Worker-group failures (``WorkerGroupError`` from the executor) fail the in-flight
        requests and rebuild the group through ``executor.restart()``, waiting
        ``restart_backoff_s`` doubled per recent failure (at most ``restart_backoff_max_s``);
        after more than ``max_restarts`` failures within ``restart_window_s`` the engine is
        dead (``healthy`` False, ``step`` raises ``EngineDeadError``)."""
        self.config = config
        self.executor = executor
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.restart_backoff_s = restart_backoff_s
        self.restart_backoff_max_s = restart_backoff_max_s
        self.last_failure: BaseException | None = None
        self.num_restarts = 0
        self._failure_times: list[float] = []
        self._restart_at: float | None = None  # set while the group awaits its rebuild
        self._dead: str | None = None
        report = executor.initialize()
        self.worker_report = report
        self.vocab_size = report.vocab_size
        self.max_model_len = resolve_max_model_len(config, report)
        sched = config.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.max_model_len:
            # Without chunking a (resumed) request must fit one step's budget whole.
            logger.warning(
                "chunked prefill is off: max_model_len lowered to max_num_batched_tokens=%d",
                sched.max_num_batched_tokens,
            )
            self.max_model_len = sched.max_num_batched_tokens

        self.kv_layout, self._kv_specs = self._plan_kv_cache(report)
        self.kv = self._new_kv_manager()
        executor.init_kv_cache(self.kv_layout)
        self.hasher = BlockHasher(self.kv.block_size)

        if tokenizer is None:
            tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else ()
        self._eos_token_ids = tuple(eos_token_ids)
        self.scheduler = self._new_scheduler([])
        self._groups: dict[str, _Group] = {}
        self._time_schedule = 0.0
        self._time_execute = 0.0

    def _plan_kv_cache(self, report: WorkerReport) -> tuple[KVCacheLayout, list[KVCacheSpec]]:
        """Group the reported layer specs and size the pool."""
        cache = self.config.cache
        # Per-rank page geometry: under decode context parallelism each rank holds B tokens of
        # every virtual block of B x dcp tokens, so bytes -> blocks is the same as without it.
        block_size = cache.block_size
        groups = kv_groups_from_report(report, block_size)
        if cache.num_gpu_blocks is not None:
            num_blocks = cache.num_gpu_blocks
        else:
            num_blocks = num_blocks_from_bytes(report.available_kv_bytes, groups)
        if num_blocks < 2:
            raise RuntimeError(
                f"no room for the KV cache: {report.available_kv_bytes} bytes give {num_blocks} "
                "blocks; raise kv_cache_memory_bytes / gpu_memory_utilization or num_gpu_blocks"
            )
        layout = KVCacheLayout(
            num_blocks=num_blocks,
            block_size=block_size,
            groups=[[int(name) for name in g.layer_names] for g in groups],
        )
        return layout, [g.spec for g in groups]

    def _new_kv_manager(self) -> KVCacheManager:
        cache = self.config.cache
        return KVCacheManager(
            self._kv_specs or None,
            self.kv_layout.num_blocks,
            self.kv_layout.block_size,
            self.max_model_len,
            enable_caching=cache.enable_prefix_caching,
            policy=cache.allocation_policy,  # type: ignore[arg-type]
            virtual_block_factor=self.config.parallel.decode_context_parallel_size,
        )

    def _new_scheduler(self, step_hooks: list[StepHook]) -> Scheduler:
        sched = self.config.scheduler
        scheduler = Scheduler(
            self.kv,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_num_seqs=sched.max_num_seqs,
            max_model_len=self.max_model_len,
            eos_token_ids=self._eos_token_ids,
            enable_chunked_prefill=sched.enable_chunked_prefill,
        )
        scheduler.step_hooks = step_hooks
        return scheduler

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request. Raises a ``RequestError`` subclass, with nothing
        changed, for a duplicate id, an empty, too long or out-of-vocabulary prompt, or a
        request the KV cache could never hold."""
        params = params if params is not None else SamplingParams()
        ids = list(prompt_token_ids)
        n = params.n
        internal_ids = [request_id] + ([f"{request_id}#{i}" for i in range(n)] if n > 1 else [])
        if request_id in self._groups or any(i in self.scheduler.requests for i in internal_ids):
            raise DuplicateRequestError(f"request id {request_id!r} is already in use")
        self._validate(ids, params)

        def seq(
            rid: str, index: int, p: SamplingParams, children: Sequence[Request] = ()
        ) -> Request:
            detok = None
            if self.tokenizer is not None and not children:
                detok = IncrementalDetokenizer(self.tokenizer, ids, p.skip_special_tokens)
            return Request(
                rid,
                ids,
                p,
                hasher=self.hasher,
                cache_salt=cache_salt,
                arrival_time=arrival_time,
                detokenizer=detok,
                group_id=request_id,
                index=index,
                children=children,
            )

        if n == 1:
            head = seq(request_id, 0, params)
            group = _Group(request_id, prompt, ids, [head], None)
        else:
            children = [
                seq(cid, i, dataclasses.replace(params, n=1, seed=child_seed(params.seed, i)))
                for i, cid in enumerate(internal_ids[1:])
            ]
            head = seq(request_id, 0, dataclasses.replace(params, n=1), children)
            group = _Group(request_id, prompt, ids, children, head)
        self.scheduler.add_request(head)
        self._groups[request_id] = group

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise EmptyPromptError("the prompt has no tokens")
        vocab = self.vocab_size
        for pos, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidTokenError(
                    f"prompt token {t!r} at position {pos} is outside the vocabulary [0, {vocab})"
                )
        if len(ids) > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}"
            )
        if params.stop and self.tokenizer is None:
            raise UnsupportedRequestError("stop strings need a tokenizer; this engine has none")
        if params.n > self.scheduler.max_num_seqs:
            raise UnsupportedRequestError(
                f"n={params.n} exceeds max_num_seqs={self.scheduler.max_num_seqs}"
            )
        # Peak KV slots of one sequence: the last sampled token is never written, and a
        # sequence stops when it reaches max_model_len.
        max_out = params.max_tokens if params.max_tokens is not None else self.max_model_len
        end = min(len(ids) + max_out, self.max_model_len)
        try:
            self.kv.check_admissible(max(len(ids), end - 1))
        except KVRequestTooLargeError as exc:
            raise RequestTooLargeError(f"the request can never fit in the KV cache: {exc}") from exc

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort wherever the request is and free its blocks. Returns its final output (unfinished
        completions get ``finish_reason="abort"``), or None for an unknown or finished id."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        ids = [s.request_id for s in group.seqs]
        if group.parent is not None:
            ids.insert(0, group.parent.request_id)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        return self._output(group)

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Schedule, execute and update once. Returns the cumulative output of every request
        that got a token or finished this step.

        When the worker group fails, every in-flight request finishes with ``finish_reason``
        ``"error"`` and ``error`` naming the rank and node, and the group is rebuilt (by the
        next call, after the backoff). Raises ``EngineDeadError`` once restarts are exhausted.
        """
        if self._dead is not None:
            raise _engine_dead(self._dead)
        failure = getattr(self.executor, "failure", None)
        if failure is not None and self._restart_at is None:
            return self._on_worker_failure(failure)  # found by the monitor between steps
        if self._restart_at is not None and not self._restart():
            return []
        if not self.scheduler.has_unfinished():
            return []
        t0 = time.perf_counter()
        sched_out = self.scheduler.schedule()
        if sched_out.total_num_scheduled_tokens == 0:
            return []
        t1 = time.perf_counter()
        try:
            runner_out = self.executor.execute(sched_out)
        except WorkerGroupError as exc:
            return self._on_worker_failure(exc)
        t2 = time.perf_counter()
        progressed = self.scheduler.update_from_output(sched_out, runner_out)
        outputs: list[RequestOutput] = []
        seen: set[str] = set()
        for req in progressed:
            gid = req.group_id
            if gid in seen or gid not in self._groups:
                continue
            seen.add(gid)
            group = self._groups[gid]
            outputs.append(self._output(group))
            if group.finished:
                del self._groups[gid]
        # The controller's share of a step (schedule + bookkeeping) against the workers'.
        self._time_execute += t2 - t1
        self._time_schedule += (t1 - t0) + (time.perf_counter() - t2)
        return outputs

    def _output(self, group: _Group) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=s.index,
                text=s.output_text,
                token_ids=list(s.output_token_ids),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                cumulative_logprob=s.cumulative_logprob,
            )
            for s in group.seqs
        ]
        cached = group.parent.num_cached_tokens if group.parent is not None else -1
        cached = max([cached, *(s.num_cached_tokens for s in group.seqs)])
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=list(group.prompt_token_ids),
            outputs=completions,
            finished=group.finished,
            num_cached_tokens=max(cached, 0),
        )

    # ------------------------------------------------------------------- faults
    @property
    def healthy(self) -> bool:
        """False once worker-group restarts are exhausted (the engine is dead)."""
        return self._dead is None

    def _on_worker_failure(self, exc: WorkerGroupError) -> list[RequestOutput]:
        """Fail every request, reset the scheduler and KV state, schedule the group's rebuild
        (or declare the engine dead). Returns the failed requests' final outputs."""
        self.last_failure = exc
        reason = str(exc)
        outputs = []
        for group in self._groups.values():
            out = self._output(group)
            for c in out.outputs:
                if c.finish_reason is None:
                    c.finish_reason = "error"
            out.finished, out.error = True, reason
            outputs.append(out)
        self._groups.clear()
        # The workers' batch state and KV contents are gone with them: start from nothing.
        self.kv = self._new_kv_manager()
        self.scheduler = self._new_scheduler(self.scheduler.step_hooks)
        self._schedule_restart(reason)
        return outputs

    def _schedule_restart(self, reason: str) -> None:
        """Count a failure; set the rebuild time (exponential backoff over the failures within
        the window) or, past the cap, declare the engine dead."""
        now = time.monotonic()
        self._failure_times = [t for t in self._failure_times if now - t < self.restart_window_s]
        self._failure_times.append(now)
        recent = len(self._failure_times)
        restartable = callable(getattr(self.executor, "restart", None))
        if recent > self.max_restarts or not restartable:
            self._dead = (
                f"worker group failed {recent} times within {self.restart_window_s:.0f} s "
                f"(at most {self.max_restarts} restarts); last failure: {reason}"
                if restartable
                else f"the worker failed and this executor cannot rebuild it: {reason}"
            )
            logger.error("engine is dead: %s", self._dead)
            self._restart_at = None
            self.executor.shutdown()
            return
        delay = min(self.restart_backoff_s * 2 ** (recent - 1), self.restart_backoff_max_s)
        self._restart_at = now + delay
        logger.warning("%s; rebuilding the worker group in %.1f s", reason, delay)

    def _restart(self) -> bool:
        """Rebuild the worker group once the backoff has passed (waiting for it, bounded by
        ``restart_backoff_max_s``). True when the group is back."""
        assert self._restart_at is not None
        time.sleep(max(0.0, min(self._restart_at - time.monotonic(), self.restart_backoff_max_s)))
        try:
            report = self.executor.restart()  # type: ignore[attr-defined]
            if report.vocab_size != self.vocab_size:
                raise RuntimeError(f"rebuilt workers report vocab {report.vocab_size}")
        except Exception as exc:
            self.last_failure = exc
            self._schedule_restart(f"restart failed: {exc}")
            if self._dead is not None:
                raise _engine_dead(self._dead) from exc
            return False
        self._restart_at = None
        self.num_restarts += 1
        logger.warning("worker group rebuilt (restart %d)", self.num_restarts)
        return True

    # -------------------------------------------------------------------- misc
    def has_unfinished(self) -> bool:
        return bool(self._groups)

    def num_unfinished(self) -> int:
        return len(self._groups)

    def stats(self) -> dict[str, int | float]:
        """Running/waiting counts, KV usage, prefix-cache queries/hits (tokens), preemptions."""
        stats: dict[str, int | float] = dataclasses.asdict(self.scheduler.stats())
        stats["kv_blocks_total"] = self.kv_layout.num_blocks - 1  # without the null block
        stats["kv_blocks_used"] = stats["kv_blocks_total"] - self.kv.num_free_blocks
        # Token capacity grows with decode context parallelism: a block spans B x dcp tokens.
        stats["kv_capacity_tokens"] = stats["kv_blocks_total"] * self.kv.block_size
        stats["time_schedule_s"] = self._time_schedule
        stats["time_execute_s"] = self._time_execute
        return stats

    def add_step_hook(self, hook: StepHook) -> None:
        """Run ``hook(scheduler, scheduler_output)`` after every schedule, e.g. to record
        ``scheduler.kv.block_fill_snapshot()``."""
        self.scheduler.step_hooks.append(hook)

    def shutdown(self) -> None:
        self.executor.shutdown()


def _engine_dead(reason: str) -> Exception:
    # client.py imports this module, so its error class is looked up when first needed.
    from pagedserve.controller.client import EngineDeadError

    return EngineDeadError(reason)
