"""Building one step's ``SchedulerOutput`` from the scheduler's decisions (deltas only)."""

from __future__ import annotations

from pagedserve.controller.request import Request
from pagedserve.kv import KVCacheBlocks, KVCacheManager
from pagedserve.messages import (
    PLACEHOLDER_TOKEN,
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)

__all__ = ["build_output"]


def build_output(
    kv: KVCacheManager,
    step_id: int,
    scheduled: list[Request],
    num_scheduled: dict[str, int],
    new_blocks: dict[str, KVCacheBlocks],
    finished_ids: list[str],
) -> SchedulerOutput:
    """The step's message: new requests in full, running ones as deltas, the KV manager's
    pending copies, and (when the step runs) the ids the workers must drop first."""
    out = SchedulerOutput(step_id=step_id)
    out.block_copies = kv.take_pending_copies()
    if scheduled:
        # Tier copies wait for a step that runs (a step that only preempted is not sent):
        # their host blocks stay referenced until then.
        out.blocks_to_host, out.blocks_to_device = kv.take_tier_copies()
    replaced = {rid for rid, *_ in kv.take_block_replacements()}
    resent: list[str] = []
    cached: CachedRequestData = out.cached_reqs
    for req in scheduled:
        rid = req.request_id
        if req.num_sent_tokens and rid in replaced:
            # Worker block tables are append-only. A copy-on-write replacement in a request
            # the workers already hold (not expected with fork-after-prefill, but possible
            # in principle) is sent as drop + full re-add; workers drop before they add.
            resent.append(rid)
            req.num_sent_tokens = 0
        pending = req.num_pending_samples
        if req.num_sent_tokens == 0:
            # Only a request the workers hold can have a sample in flight: a full (re-)add
            # follows a preemption or a fork, which leave none pending.
            assert not pending, f"request {rid!r} re-sent with {pending} samples in flight"
            out.new_reqs.append(
                NewRequestData(
                    req_id=rid,
                    prompt_token_ids=list(req.prompt_token_ids),
                    output_token_ids=list(req.output_token_ids),
                    sampling_params=req.worker_params,
                    block_ids=[list(ids) for ids in kv.get_block_ids(rid)],
                    num_computed_tokens=req.num_computed_tokens,
                )
            )
        else:
            blocks = new_blocks.get(rid)
            cached.req_ids.append(rid)
            # Samples of steps still running are not known here: each goes as a placeholder
            # that the workers fill with their own sample. The workers' copy is the known
            # tokens then the placeholders; a placeholder sent once counts as sent even after
            # its token becomes known.
            sent = req.num_sent_tokens
            cached.new_token_ids.append(
                req.all_token_ids[sent:]
                + [PLACEHOLDER_TOKEN] * (req.num_tokens + pending - max(sent, req.num_tokens))
            )
            cached.new_block_ids.append(
                [list(ids) for ids in blocks.get_block_ids()] if blocks else None
            )
            cached.num_computed_tokens.append(req.num_computed_tokens)
        req.num_sent_tokens = req.num_tokens + pending
        # The drafts this step reaches (a chunk cut by the budget may reach only some).
        num_drafts = req.num_computed_tokens + num_scheduled[rid] - req.num_tokens
        if req.draft_token_ids and num_drafts > 0:
            out.draft_token_ids[rid] = req.draft_token_ids[:num_drafts]
    out.num_scheduled_tokens = num_scheduled
    out.total_num_scheduled_tokens = sum(num_scheduled.values())
    if out.total_num_scheduled_tokens:
        # An empty step is not sent to the workers, so the drop list waits for a real one.
        # The workers apply drops before additions: an aborted id may be re-added at once.
        out.finished_req_ids = finished_ids + resent
    return out
