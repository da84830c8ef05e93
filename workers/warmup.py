"""A throwaway prefill and decode step through the model runner before the engine says ready.

The first step of a fresh worker pays for work that is done lazily: loading the compiled CPU
kernels, oneDNN creating its matmul primitives, the OpenMP pool starting its threads, the
sampler's first kernels. Without this, that cost lands on the first user's request (its time to
first token several times the median); here it is paid while the server starts, before
``/health`` answers.

The requests write their KV into the null block only (every block id is 0), so nothing in the
pool that a real request can read changes, and the null block is zeroed again afterwards.
"""

from __future__ import annotations

import torch

from pagedserve.messages import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from pagedserve.workers.model_runner import ModelRunner

# Long enough for the batched prefill paths (attention takes the GEMM path past 16 query
# tokens), short enough to cost little at start-up.
WARMUP_PROMPT_TOKENS = 32

# Step ids below every real one: the engine numbers its steps from 0 up.
_FIRST_STEP_ID = -3

# One greedy row and one seeded random row; the shared generator's state is restored after, so
# unseeded sampling later draws what it would have drawn without the warm-up. Room for more
# tokens than the two steps make, so that a draft model drafts after them.
_PARAMS = (
    SamplingParams(max_tokens=16, temperature=0.0),
    SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=8, seed=0),
)


def warm_up(runner: ModelRunner, num_groups: int, block_size: int, max_model_len: int) -> None:
    """One prefill step and one decode step of two throwaway requests (one after the other
    when the batch holds one row), then drop them."""
    prompt_len = max(1, min(WARMUP_PROMPT_TOKENS, max_model_len - 1))
    num_blocks = -(-(prompt_len + 1) // block_size)
    ids = [f"__warmup_{i}__" for i in range(len(_PARAMS))]
    new = [
        NewRequestData(rid, [0] * prompt_len, [], params, [[0] * num_blocks] * num_groups, 0)
        for rid, params in zip(ids, _PARAMS, strict=True)
    ]
    rng_state = runner.sampler.generator.get_state()
    seats = runner.batch.max_num_reqs
    for first in range(0, len(new), seats):
        _steps(runner, new[first : first + seats], prompt_len)
    runner.sampler.generator.set_state(rng_state)
    with torch.inference_mode():
        for tensor in runner.kv_pool.tensors:  # [num_blocks, 2, B, H_kv, D]
            tensor[0].zero_()


def _steps(runner: ModelRunner, new: list[NewRequestData], prompt_len: int) -> None:
    ids = [r.req_id for r in new]
    step = _FIRST_STEP_ID
    # A draft model drafts after both steps (into the null block, like the rest).
    k = runner.draft.num_speculative_tokens if runner.draft is not None else 0
    out = runner.execute(SchedulerOutput(
        step, new_reqs=new, num_scheduled_tokens=dict.fromkeys(ids, prompt_len),
        total_num_scheduled_tokens=prompt_len * len(ids), num_lookahead_tokens=k,
    ))
    sampled = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
    cached = CachedRequestData(
        req_ids=ids, new_token_ids=[sampled[r] for r in ids],
        new_block_ids=[None] * len(ids), num_computed_tokens=[prompt_len] * len(ids),
    )
    runner.execute(SchedulerOutput(
        step + 1, cached_reqs=cached, num_scheduled_tokens=dict.fromkeys(ids, 1),
        total_num_scheduled_tokens=len(ids), num_lookahead_tokens=k,
    ))
    runner.execute(SchedulerOutput(step + 2, finished_req_ids=ids))
