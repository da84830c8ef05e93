"""The scheduler: one token budget, running requests first, then waiting ones.

There are no prefill or decode phases. Every request catches ``num_computed_tokens`` up to its
``compute_limit`` (its tokens, a placeholder per sample still in flight under async scheduling,
and drafts to verify): a long prompt takes several steps (chunked prefill), a generating request
one token per step (one per draft, or several passes of one in a small batch,
``decode_steps``). When the KV cache is full the newest running request is
preempted and nothing new is admitted that step: by recompute (its blocks freed, it starts over,
mostly from the prefix cache) or, with ``preemption_mode="swap"``, by swapping its blocks to the
host tier and back (recompute when the tier is full).

The order is a policy (``request_order``): ``fcfs`` or ``priority``.

Parallel sampling (``n > 1``) forks a request once its prompt is computed (``forks``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Collection, Iterable
from typing import Any

from pagedserve.config import SCHEDULING_POLICIES
from pagedserve.controller.decode_steps import decode_steps
from pagedserve.controller.engine_stats import BATCHED_TOKENS_BUCKETS, SchedulerStats
from pagedserve.controller.forks import dissolve_parent, fork
from pagedserve.controller.request import Request, RequestStatus
from pagedserve.controller.request_order import enqueue, start_running
from pagedserve.controller.step_output import build_output
from pagedserve.kv import KVCacheBlocks, KVCacheManager
from pagedserve.messages import ModelRunnerOutput, SchedulerOutput

__all__ = ["Scheduler", "StepHook"]

StepHook = Callable[["Scheduler", SchedulerOutput], None]
"""Called after every ``schedule()``, when the step's blocks are allocated but not yet freed
(the moment to take ``kv.block_fill_snapshot()``)."""


def _fit_chunk(
    allocate: Callable[..., KVCacheBlocks | None], req: Request, n: int, shrink: bool, *args: Any
) -> tuple[int, KVCacheBlocks | None]:
    """``allocate(req, n, *args)``; with ``shrink``, halve a chunk that does not fit until it
    does or is one token (a smaller prefill chunk needs fewer blocks: a sliding window holds the
    window plus the chunk). Returns the chunk and its blocks, None if none fits."""
    blocks = allocate(req, n, *args)
    while blocks is None and shrink and n > 1:
        n = max(1, n // 2)
        blocks = allocate(req, n, *args)
    return n, blocks


class Scheduler:
    """Owns the waiting queue and the running list; decides each step's batch.

    Mutation: only the scheduler changes a ``Request``'s status and ``num_computed_tokens`` and
    only it calls the KV manager's mutating methods.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: Collection[int] = (),
        enable_chunked_prefill: bool = True,
        preemption_mode: str = "recompute",
        num_lookahead_tokens: int = 0,
        policy: str = "fcfs",
        num_scheduler_steps: int = 1,
    ) -> None:
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"unknown preemption_mode {preemption_mode!r}")
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.policy = policy
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.num_lookahead_tokens = num_lookahead_tokens
        """Slots past each chunk for a draft model's drafts (0: none); the engine sets it."""
        self.num_scheduler_steps = num_scheduler_steps  # see ``decode_steps``
        self.requests: dict[str, Request] = {}
        """Every live request, unforked children included."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step_hooks: list[StepHook] = []
        self.num_preemptions = 0
        self._step_id = 0
        self._batched_counts = [0] * (len(BATCHED_TOKENS_BUCKETS) + 1)
        self._batched_sum = 0
        self._multi_pass_steps = 0
        # Requests the workers hold and must drop at the next step (finished, aborted, forked
        # parents, preempted).
        self._finished_ids: list[str] = []
        # Block-table lengths the workers must cut rows to at the next step (blocks that only
        # rejected drafts filled, given back).
        self._trims: dict[str, int] = {}

    # ----------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        """Queue a validated request (and register its unforked children, if any)."""
        for r in (request, *request.children):
            if r.request_id in self.requests:
                raise ValueError(f"request id {r.request_id!r} is already live")
        for r in (request, *request.children):
            self.requests[r.request_id] = r
        if request.children and (request.compute_limit == 0 or self.kv.policy == "reserve"):
            # A one-token prompt leaves the parent nothing to compute; under the ``reserve``
            # baseline every sequence holds its own max_model_len worth of blocks anyway, so
            # forking would only share empty reservations. Start the children directly.
            dissolve_parent(self.requests, self.waiting, self.policy, request,
                            at_front=False)
        else:
            enqueue(self.waiting, request, self.policy, front=False)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish (usually abort) requests wherever they are; frees their blocks. Unknown or
        already finished ids are ignored. A fork parent takes its unforked children along."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            for r in (req, *req.children):
                if self.requests.pop(r.request_id, None) is not None:
                    self._drop(r)
                    r.finish(status)

    def _drop(self, req: Request) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.kv.has_request(req.request_id):
            self.kv.free(req)
        self._trims.pop(req.request_id, None)
        if req.num_sent_tokens:
            self._finished_ids.append(req.request_id)
            req.num_sent_tokens = 0

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        pc = self.kv.prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), kv_usage=self.kv.usage,
            prefix_cache_queries=pc.queries, prefix_cache_hits=pc.hits,
            num_preemptions=self.num_preemptions,
            num_steps=self._step_id,
            num_swapped=len(self.kv.host.swapped) if self.kv.host is not None else 0,
            batched_tokens_counts=tuple(self._batched_counts),
            batched_tokens_sum=self._batched_sum,
            num_multi_pass_steps=self._multi_pass_steps,
        )

    # ----------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, KVCacheBlocks] = {}
        scheduled: list[Request] = []
        preempted = False
        steps = decode_steps(self.running, len(self.waiting), self.num_scheduler_steps)
        lookahead = steps - 1 if steps > 1 else self.num_lookahead_tokens

        # 1. Running requests, in the policy's order. A victim is always popped from the end, so
        # it is never one that was already scheduled this step.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.compute_limit - req.num_computed_tokens, budget)
            if n <= 0 or req.pending_sample_is_last(self.max_model_len):
                i += 1
                continue
            while True:
                # With nobody left to preempt but itself, it tries a smaller chunk first.
                alone = self.running[-1] is req and self.enable_chunked_prefill
                n, blocks = _fit_chunk(self._allocate_slots, req, n, alone, 0, None, lookahead)
                if blocks is not None:
                    break
                victim = self.running.pop()
                self.preempt(victim)
                preempted = True
                if victim is req:
                    break
            if blocks is None:
                break
            scheduled.append(req)
            num_scheduled[req.request_id] = n
            new_blocks[req.request_id] = blocks
            budget -= n
            i += 1

        # 2. Waiting requests, unless this step had to preempt: admitting now would only
        # preempt again next step.
        if not preempted:
            self._admit_waiting(budget, scheduled, num_scheduled)

        output = build_output(
            self.kv, self._step_id, scheduled, num_scheduled, new_blocks, self._finished_ids
        )
        output.num_lookahead_tokens = self.num_lookahead_tokens
        output.num_decode_steps = 1 if preempted else steps
        if output.total_num_scheduled_tokens:
            self._finished_ids = []
            output.block_table_trims, self._trims = self._trims, {}
        for req in scheduled:
            req.advance(num_scheduled[req.request_id])
        if total := output.total_num_scheduled_tokens:
            self._batched_counts[bisect_left(BATCHED_TOKENS_BUCKETS, total)] += 1
            self._batched_sum += total
            self._multi_pass_steps += output.num_decode_steps > 1
        self._step_id += 1
        for hook in self.step_hooks:
            hook(self, output)
        return output

    def _admit_waiting(
        self, budget: int, scheduled: list[Request], num_scheduled: dict[str, int]
    ) -> None:
        # A fork parent takes the seats of all its children: they replace it in the batch.
        seats = sum(max(1, len(r.children)) for r in self.running)
        while self.waiting and budget > 0:
            req = self.waiting[0]
            need_seats = max(1, len(req.children))
            if seats + need_seats > self.max_num_seqs:
                break
            if self.kv.is_swapped(req.request_id):
                if not self._swap_in(req, budget, scheduled, num_scheduled):
                    break
                budget -= num_scheduled[req.request_id]
                seats += need_seats
                continue
            hit_blocks: KVCacheBlocks | None = None
            hit = 0
            # Prompt positions served from the cache are never computed, so their logprobs
            # would be lost: such a request computes its whole prompt (its blocks still get
            # cached for others).
            if not req.needs_prompt_logprobs:
                hit_blocks, hit = self.kv.get_computed_blocks(req)
            if req.children and hit >= req.compute_limit:
                # The cache already holds the parent's whole share: the children hit it alone.
                self.waiting.popleft()
                dissolve_parent(self.requests, self.waiting, self.policy, req,
                                at_front=True)
                continue
            n = req.compute_limit - hit
            if not self.enable_chunked_prefill and n > budget:
                break
            # Alone in the cache, a request whose steady state fits must run: its chunk shrinks.
            shrink = not self.running and self.enable_chunked_prefill
            cached = (hit, hit_blocks if hit else None)
            n, blocks = _fit_chunk(self._allocate_slots, req, min(n, budget), shrink, *cached)
            if blocks is None:
                break
            self.waiting.popleft()
            start_running(self.running, req, self.policy)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit
                if hit_blocks is not None:
                    req.num_host_cached_tokens = len(hit_blocks.host) * self.kv.block_size
            scheduled.append(req)
            num_scheduled[req.request_id] = n
            budget -= n
            seats += need_seats

    def _allocate_slots(
        self, req: Request, n: int, hit: int = 0, hit_blocks: KVCacheBlocks | None = None,
        lookahead: int | None = None,
    ) -> KVCacheBlocks | None:
        """``kv.allocate_slots`` with lookahead slots (the drafts', unless given), or without
        them rather than preempt."""
        lookahead = self.num_lookahead_tokens if lookahead is None else lookahead
        blocks = self.kv.allocate_slots(req, n, hit, hit_blocks, lookahead)
        if blocks is None and lookahead:
            blocks = self.kv.allocate_slots(req, n, hit, hit_blocks, 0)
        return blocks

    def _swap_in(
        self, req: Request, budget: int, scheduled: list[Request], num_scheduled: dict[str, int]
    ) -> bool:
        """Resume a swapped request where it stopped (its blocks come back from the host)."""
        n = req.compute_limit - req.num_computed_tokens
        if not self.enable_chunked_prefill and n > budget:
            return False
        shrink = not self.running and self.enable_chunked_prefill
        n, blocks = _fit_chunk(self.kv.swap_in, req, min(n, budget), shrink)
        if blocks is None:
            return False
        self.waiting.popleft()
        start_running(self.running, req, self.policy)
        req.status = RequestStatus.RUNNING
        scheduled.append(req)
        num_scheduled[req.request_id] = n
        return True

    def preempt(self, req: Request, *, recompute: bool = False) -> None:
        """Free the request's device blocks and queue it at the waiting head: swapped to the
        host tier (it resumes where it stopped) or, failing that or with ``recompute``, to
        start over. The caller has taken it out of the running list."""
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        req.num_pending_samples = 0  # the in-flight step's sample for it is dropped
        req.draft_token_ids = []
        self._trims.pop(req.request_id, None)
        # Swapping needs a next token to resume with; one with nothing left starts over.
        swap = not recompute and self.preemption_mode == "swap"
        swap = swap and req.compute_limit > req.num_computed_tokens
        if not (swap and self.kv.swap_out(req)):
            self.kv.free(req)
            req.num_computed_tokens = 0
        if req.num_sent_tokens:
            self._finished_ids.append(req.request_id)
            req.num_sent_tokens = 0
        enqueue(self.waiting, req, self.policy, front=True)
        self.num_preemptions += 1

    # ------------------------------------------------------------------ update
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Record prompt logprobs, append sampled tokens, apply stop conditions, free finished
        requests and fork parents that are ready. Returns the requests that got a token, new
        prompt logprobs or finished (a request may appear twice)."""
        progressed: list[Request] = []
        for rid, (first, ids, lps) in (runner_output.prompt_logprobs or {}).items():
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                if req.record_prompt_logprobs(first, ids, lps):
                    progressed.append(req)
        logprobs = runner_output.logprobs
        for j, (rid, tokens) in enumerate(
            zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True)
        ):
            req = self.requests.get(rid)
            # Aborted or preempted since the step was scheduled (its sample is stale), or a
            # sample of a request that did not reach its end: ignore it, its tokens stay.
            if req is None or req.status != RequestStatus.RUNNING or not req.num_pending_samples:
                continue
            req.num_pending_samples -= 1
            if not tokens:
                continue
            if req.sampling_params.max_tokens == 0:
                # Prompt only (scoring): the sample is dropped.
                req.finish(RequestStatus.FINISHED_LENGTH_CAPPED)
            else:
                lps = None if logprobs is None else logprobs[j]
                req.append_output_token_ids(tokens, lps, self.eos_token_ids, self.max_model_len)
                # Every appended token but the last was an input of this step, so its KV is
                # computed; the slots of rejected drafts are not. A step scheduled after this
                # one computes the placeholders of its pending samples.
                req.num_computed_tokens = req.num_tokens - 1 + req.num_pending_samples
            progressed.append(req)
            if req.is_finished:
                self.requests.pop(rid, None)
                self.running.remove(req)
                self.kv.free(req)
                self._finished_ids.append(rid)
                req.num_sent_tokens = 0
        for rid in scheduler_output.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.draft_token_ids and req.status == RequestStatus.RUNNING:
                # Blocks only rejected drafts filled go back to the pool.
                keep = self.kv.trim(req)
                if keep is not None:
                    self._trims[rid] = keep
            req.draft_token_ids = []  # verified, or not reached: a drafter proposes anew
            ready = req.num_computed_tokens >= req.compute_limit
            if req.children and req.status == RequestStatus.RUNNING and ready:
                fork(self.kv, self.requests, self.running, req)
                self._finished_ids.append(rid)
                req.num_sent_tokens = 0
        return progressed
