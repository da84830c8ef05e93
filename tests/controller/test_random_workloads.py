"""Random workloads: adds, aborts and steps under tight memory and budgets.

The fake worker's next token depends only on the previous token and the seed, so each finished
completion has a closed-form expected output whatever the scheduling (chunking, prefix hits,
forks, preemptions, and with async scheduling a step scheduled while the one before runs).
The fake also checks every KV read, and kv's integrity is checked after every step.
"""

from __future__ import annotations

import random

import pytest

from pagedserve.controller.request import child_seed
from pagedserve.messages import SamplingParams


def expected_tokens(kit, prompt, seed, max_tokens, max_model_len, vocab=1000, stops=()):
    """The completion and its finish reason."""
    out, last = [], prompt[-1]
    while len(out) < max_tokens and len(prompt) + len(out) < max_model_len:
        last = kit.next_token(last, seed, vocab)
        out.append(last)
        if last in stops:
            return out, "stop"
    return out, "length"


@pytest.mark.parametrize(("overlap", "steps"), [(False, 1), (True, 1), (False, 4), (True, 4)],
                         ids=["sync", "async", "sync-4-passes", "async-4-passes"])
@pytest.mark.parametrize("seed", range(24))
def test_random_workload(kit, seed, overlap, steps):
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    max_model_len = 48
    eng = kit.make_engine(
        block_size=block_size,
        num_gpu_blocks=max_model_len // block_size + 1 + rng.randint(0, 12),
        max_num_batched_tokens=rng.choice([8, 16, 48]),
        max_num_seqs=rng.choice([3, 4, 8]),
        max_model_len=max_model_len,
        enable_prefix_caching=rng.random() < 0.8,
        allocation_policy="reserve" if rng.random() < 0.2 else "paged",
        executor=kit.FakeExecutor(max_model_len=max_model_len, overlaps_steps=overlap),
        num_scheduler_steps=steps,
    )
    shared = [rng.randint(1, 999) for _ in range(20)]
    specs: dict[str, tuple[list[int], SamplingParams]] = {}
    aborted: set[str] = set()
    finished: dict = {}
    next_id = 0
    for _ in range(400):
        r = rng.random()
        if r < 0.25:
            if next_id >= 30:
                continue
            n_prompt = rng.randint(1, 24)
            prompt = (
                shared[:n_prompt]
                if rng.random() < 0.5
                else [rng.randint(1, 999) for _ in range(n_prompt)]
            )
            seed_ = rng.randint(0, 10_000)
            max_tokens = rng.randint(1, 24)
            # Sometimes a stop token the completion reaches before its length (n = 1): the
            # request ends early, which a step scheduled ahead learns a step late.
            want, _ = expected_tokens(kit, prompt, seed_, max_tokens, max_model_len)
            stops = [want[rng.randrange(len(want))]] if want and rng.random() < 0.3 else []
            params = SamplingParams(
                n=1 if stops else rng.choice([1, 1, 2, 3]),
                max_tokens=max_tokens,
                seed=seed_,
                stop_token_ids=stops,
            )
            rid = f"q{next_id}"
            next_id += 1
            eng.add_request(rid, prompt, params)
            specs[rid] = (prompt, params)
        elif r < 0.265 and eng.has_unfinished():
            rid = rng.choice(sorted(eng._groups))
            eng.abort_request(rid)
            aborted.add(rid)
        else:
            for out in eng.step():
                if out.finished:
                    finished[out.request_id] = out
        eng.kv.check_integrity()
    finished.update(kit.run(eng))
    kit.assert_idle(eng)
    for rid, out in finished.items():
        if rid in aborted:
            continue
        prompt, params = specs[rid]
        for c in out.outputs:
            want, reason = expected_tokens(
                kit, prompt, child_seed(params.seed, c.index), params.max_tokens, max_model_len,
                stops=params.stop_token_ids,
            )
            assert c.token_ids == want, (rid, c.index)
            assert c.finish_reason == reason
    assert set(finished) | aborted == set(specs)
    if steps > 1:  # some steps ran several passes, and none behind another step
        assert any(so.num_decode_steps == steps for so in eng.executor.outputs)
    if overlap:
        assert eng.stats()["num_overlapped_steps"] > 0
        assert eng.executor.max_in_flight == 2
