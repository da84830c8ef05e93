"""Carrying the live requests over a worker-group failure.

The workers' batch rows and KV blocks (device and host tier alike) die with the group, but the
controller holds all a request needs to go on: its prompt, the tokens generated so far and its
sampling parameters (a seeded request's noise is a function of its seed and position on the
workers, so no random state is lost). A failure therefore preempts every live request by
recompute: each goes into a fresh scheduler's waiting queue, the previously running ones first
(in their running order), then the waiting ones (in queue order), with nothing computed and
nothing sent, and continues after the rebuild where it stopped. Its stream only sees a pause.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pagedserve.controller.errors import EngineDeadError, RequestFailedError
from pagedserve.controller.outputs import RequestGroup, failed_delta
from pagedserve.controller.request import Request, RequestStatus
from pagedserve.controller.scheduler import Scheduler
from pagedserve.messages import RequestDelta

__all__ = ["count_failure", "drop_over_limit", "fail_all", "fail_over_limit", "fail_unschedulable",
           "live_heads", "resume"]

logger = logging.getLogger(__name__)


def live_heads(sched: Scheduler) -> list[Request]:
    """The scheduler's queue entries, running first, then waiting. A fork parent stands for
    its unforked children (``Request.children``), as in the queues."""
    return [*sched.running, *sched.waiting]


def count_failure(sched: Scheduler) -> None:
    """Count the failure against every sequence the failed group was running (the unforked
    children of a running fork parent too: the parent computes their shared prompt). Waiting
    requests lost nothing the workers held that they cannot recompute, and cannot have caused
    the failure, so they are not counted."""
    for req in sched.running:
        for r in (req, *req.children):
            r.num_failures += 1


def drop_over_limit(heads: list[Request], limit: int) -> dict[str, int]:
    """Finish (aborted) every sequence of each user request that has a sequence run through
    more than ``limit`` failures, so it is not resumed: the request's sequences share its
    fate. Returns those requests' ids (``group_id``) with their failure counts."""
    over = {h.group_id: r.num_failures for h in heads for r in (h, *h.children)
            if r.num_failures > limit}
    for h in heads:
        if h.group_id in over:
            for r in (h, *h.children):
                r.finish(RequestStatus.FINISHED_ABORTED)
    return over


def fail_over_limit(heads: list[Request], groups: dict[str, RequestGroup], limit: int,
                    reason: str) -> list[RequestDelta]:
    """Fail (and remove from ``groups``) the requests that have now run through more failures
    than ``limit``: one that kills its workers whenever it runs would otherwise spend the whole
    restart budget."""
    deltas = []
    for gid, n in drop_over_limit(heads, limit).items():
        group = groups.pop(gid, None)
        if group is None:
            continue
        logger.error("request %s failed: it ran through %d worker-group failures", gid, n)
        deltas.append(failed_delta(
            gid, [s.index for s in group.seqs if not s.emitted_final],
            f"{reason}; the request ran through {n} worker-group failures "
            f"(max_failures_per_request={limit})", RequestFailedError.__name__,
        ))
    return deltas


def fail_all(groups: dict[str, RequestGroup], reason: str) -> list[RequestDelta]:
    """The engine is dead: an ``EngineDeadError`` delta ending every request (``groups``
    emptied)."""
    deltas = [
        failed_delta(g.request_id, [s.index for s in g.seqs if not s.emitted_final],
                     reason, EngineDeadError.__name__)
        for g in groups.values()
    ]
    groups.clear()
    return deltas


def resume(heads: Iterable[Request], sched: Scheduler) -> None:
    """Queue ``heads`` (from a scheduler whose workers are gone) in the fresh ``sched``, in
    order, as preempted by recompute; ``add_request`` registers a fork parent's children and
    dissolves a parent that no longer needs to compute first."""
    for head in heads:
        for r in (head, *head.children):
            _forget_workers(r)
        sched.add_request(head)


def _forget_workers(req: Request) -> None:
    if req.status == RequestStatus.RUNNING:
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
    # Nothing is computed on the new group, and a swapped request's host blocks are gone too.
    req.num_computed_tokens = 0
    # The new workers hold no row: each request is sent in full (prompt and outputs) when it
    # is scheduled again, and none needs dropping first.
    req.num_sent_tokens = 0
    req.num_pending_samples = 0  # the dead group's steps never answer
    req.draft_token_ids = []  # proposed for the dead group's step; a drafter proposes anew


def fail_unschedulable(sched: Scheduler, groups: dict[str, RequestGroup]) -> list[RequestDelta]:
    """A step that schedules nothing while requests wait and nothing runs would repeat
    forever: admission promised the head request that it fits. Fail that request, loudly,
    instead of spinning."""
    if sched.running or not sched.waiting:
        return []
    head = sched.waiting[0]
    group = groups.pop(head.group_id, None)
    reason = (
        f"internal error: request {head.group_id!r} ({head.num_tokens} tokens, "
        f"{head.num_computed_tokens} computed) cannot be scheduled in an empty cache of "
        f"{sched.kv.num_free_blocks} free blocks of {sched.kv.block_size} tokens "
        f"(token budget {sched.max_num_batched_tokens}); it is failed instead of retried"
    )
    logger.error("%s", reason)
    if group is None:  # not a user request: drop it all the same
        sched.finish_requests([head.request_id], RequestStatus.FINISHED_ABORTED)
        return []
    sched.finish_requests(group.seq_ids(), RequestStatus.FINISHED_ABORTED)
    return [failed_delta(group.request_id, [s.index for s in group.seqs], reason,
                         RequestFailedError.__name__)]
