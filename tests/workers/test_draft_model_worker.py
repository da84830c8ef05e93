"""The workers' draft model, step by step on one ``Worker``: each sampling row drafts as far as
its blocks, ``max_model_len`` and ``max_tokens`` allow (none past them), and the drafts are the
draft model's greedy continuation after the accepted tokens. The target is its own draft here,
so every draft is also transformers' greedy of the target."""

from __future__ import annotations

from pathlib import Path

from helpers.checkpoints import hf_greedy, load_hf_model, make_checkpoint

from pagedserve.config import from_flat
from pagedserve.messages import (
    CachedRequestData,
    KVCacheLayout,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from pagedserve.workers.worker import Worker

BS = 4
K = 3


def test_rows_draft_within_their_blocks_and_max_tokens(tmp_path: Path) -> None:
    path = make_checkpoint("llama", tmp_path / "llama", init_std=0.05)
    config = from_flat(model=str(path), dtype="float32", block_size=BS, max_num_seqs=4,
                       speculative_config={"method": "draft_model", "model": str(path),
                                           "num_speculative_tokens": K})
    worker = Worker(config)
    report = worker.load_model()
    assert len(report.draft_layer_specs) == len(report.layer_specs) == 2
    worker.init_kv_cache(KVCacheLayout(32, BS, [[0, 1]], draft_groups=[0, 0]))
    prompts = {"a": [5, 9, 33, 7, 81, 12], "b": [3, 4, 5, 6, 7, 8, 9, 10],
               "c": [40, 41, 42, 43, 44], "d": [90, 17, 90, 17, 90]}
    blocks = {"a": [1, 2], "b": [3, 4], "c": [5, 6, 7], "d": [8, 9, 10]}
    # a: 8 slots for 7 tokens, room for 2 guesses; b: its 8 slots end at its 8 tokens, no
    # room; c: max_tokens=2 leaves no room; d: room for all K.
    params = {r: SamplingParams(max_tokens=2 if r == "c" else 20, temperature=0.0)
              for r in prompts}
    model = load_hf_model(path)
    greedy = {r: hf_greedy(model, p, 8) for r, p in prompts.items()}
    new = [NewRequestData(r, p, [], params[r], [blocks[r]], 0) for r, p in prompts.items()]
    out = worker.execute(SchedulerOutput(
        0, new_reqs=new, num_scheduled_tokens={r: len(p) for r, p in prompts.items()},
        total_num_scheduled_tokens=sum(map(len, prompts.values())), num_lookahead_tokens=K,
    ))
    assert dict(zip(out.req_ids, out.sampled_token_ids, strict=True)) == {
        r: greedy[r][:1] for r in prompts}
    assert out.draft_token_ids == {"a": greedy["a"][1:3], "d": greedy["d"][1:4]}
    # d verifies its drafts: all are accepted, and it drafts on from the token after them.
    drafts = out.draft_token_ids["d"]
    out = worker.execute(SchedulerOutput(
        1, cached_reqs=CachedRequestData(["d"], [greedy["d"][:1]], [None], [5]),
        num_scheduled_tokens={"d": 1 + K}, total_num_scheduled_tokens=1 + K,
        draft_token_ids={"d": drafts}, num_lookahead_tokens=K,
    ))
    assert out.sampled_token_ids == [greedy["d"][1:5]]
    # Its next guesses write the KV of positions 9 to 11, the last slots of its blocks.
    assert out.draft_token_ids == {"d": greedy["d"][5:8]}
    worker.shutdown()
