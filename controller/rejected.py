"""What a step leaves behind when the workers reject some of its new requests.

A rejected request (``ModelRunnerOutput.request_errors``: a value the checks at admission
missed) ran nothing, but the scheduler had already given it blocks, counted its tokens as
computed and registered its newly full blocks in the prefix cache. Those blocks hold no KV:
they leave the cache. A request admitted later in the same step may have hit one of them and
read it; its output of the step is void too, and so are the blocks it wrote in turn. It is
computed again (preempted by recompute), which costs it a step and changes none of its tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from pagedserve.controller.errors import RequestFailedError
from pagedserve.controller.outputs import RequestGroup, failed_delta
from pagedserve.controller.request import RequestStatus
from pagedserve.controller.scheduler import Scheduler
from pagedserve.messages import RequestDelta, SchedulerOutput

__all__ = ["fail_rejected", "unwritten_blocks", "void_rejected"]

logger = logging.getLogger(__name__)


def _written(sched: Scheduler, so: SchedulerOutput, rid: str) -> set[int]:
    """Block ids (every KV group) holding the positions ``rid`` computed this step."""
    n = so.num_scheduled_tokens.get(rid, 0)
    req = sched.requests.get(rid)
    if not n or req is None or not sched.kv.has_request(rid):
        return set()
    bs = sched.kv.block_size
    end = req.num_computed_tokens  # already advanced by the schedule
    lo, hi = (end - n) // bs, -(-end // bs)
    return {b for ids in sched.kv.get_block_ids(rid) for b in ids[lo:hi] if b != 0}


def unwritten_blocks(
    sched: Scheduler, so: SchedulerOutput, rejected: Collection[str]
) -> tuple[set[int], list[str]]:
    """(the blocks this step should have written and did not, the other scheduled requests
    that read one of them), for ``rejected`` scheduler ids (a rejected request's whole group).

    Call before anything is freed. Readers are found to a fixed point: a reader's own blocks
    were computed from what it read, so whoever read those is a reader too."""
    unwritten: set[int] = set()
    for rid in rejected:
        unwritten |= _written(sched, so, rid)
    others = [r for r in so.num_scheduled_tokens if r not in rejected and sched.kv.has_request(r)]
    readers: list[str] = []
    grew = bool(unwritten)
    while grew:
        grew = False
        for rid in others:
            if rid in readers:
                continue
            if any(b in unwritten for ids in sched.kv.get_block_ids(rid) for b in ids):
                readers.append(rid)
                unwritten |= _written(sched, so, rid)
                grew = True
    return unwritten, readers


def void_rejected(sched: Scheduler, so: SchedulerOutput, rejected: Collection[str]) -> None:
    """Undo what this step's schedule did for ``rejected`` that the workers never did: forget
    the blocks left unwritten and compute the requests that read them again. The caller then
    finishes the rejected requests (which frees their blocks)."""
    unwritten, readers = unwritten_blocks(sched, so, rejected)
    sched.kv.pool.uncache(unwritten)
    for rid in readers:
        req = sched.requests[rid]
        sched.running.remove(req)
        sched.preempt(req, recompute=True)


def fail_rejected(
    sched: Scheduler, groups: dict[str, RequestGroup], so: SchedulerOutput,
    errors: dict[str, str],
) -> list[RequestDelta]:
    """Fail the groups (removed from ``groups``) of the requests the workers rejected, and
    nothing else: their unwritten blocks leave the prefix cache and whoever read one this step
    is computed again. Neither the worker group nor the restart budget is touched."""
    failing = {
        g.request_id: g for rid in errors
        if (req := sched.requests.get(rid)) is not None
        and (g := groups.get(req.group_id)) is not None
    }
    void_rejected(sched, so, {s for g in failing.values() for s in g.seq_ids()})
    deltas = []
    for gid, group in failing.items():
        error = next(errors[s] for s in group.seq_ids() if s in errors)
        logger.error("request %s failed on the workers: %s", gid, error)
        sched.finish_requests(group.seq_ids(), RequestStatus.FINISHED_ABORTED)
        del groups[gid]
        deltas.append(failed_delta(
            gid, [s.index for s in group.seqs], f"the workers could not serve it: {error}",
            RequestFailedError.__name__,
        ))
    return deltas
