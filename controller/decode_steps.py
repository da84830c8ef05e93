"""How many decode passes a step asks of the workers (``SchedulerOutput.num_decode_steps``).

One request at a time, a decode pass takes a few milliseconds on a CPU, and the controller's
turn around it (taking in the sample, detokenizing, scheduling, sending) is a share of that.
Several passes per message pay that turn once per several tokens. They are asked for only
where nothing else could use the step: a small batch that only decodes, with no request
waiting to be admitted. A larger batch's pass is long enough that the turn is a small share of
it, and several passes would keep a new arrival waiting for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.controller.request import Request

__all__ = ["MULTI_STEP_MAX_SEQS", "decode_steps"]

MULTI_STEP_MAX_SEQS = 4
"""The most running requests for which a step runs several decode passes."""


def decode_steps(running: Sequence[Request], num_waiting: int, num_scheduler_steps: int) -> int:
    """``num_scheduler_steps`` when every running request (at most ``MULTI_STEP_MAX_SEQS``)
    decodes one token with nothing the step's samples decide on the controller (drafts to
    verify, a grammar's mask, a fork) and nothing waits; else 1."""
    if num_scheduler_steps == 1 or num_waiting or not 0 < len(running) <= MULTI_STEP_MAX_SEQS:
        return 1
    for req in running:
        if (req.children or req.draft_token_ids or req.grammar is not None
                or req.compute_limit - req.num_computed_tokens != 1
                or req.sampling_params.max_tokens == 0):
            return 1
    return num_scheduler_steps
