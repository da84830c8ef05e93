"""The model runner samples several positions of a row (a request's drafts): one pass gives the
same tokens and logprobs as sampling the positions step by step, and keeps the samples up to
the first that is not the draft."""

from __future__ import annotations

import pytest

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.messages import CachedRequestData, KVCacheLayout, NewRequestData, SamplingParams
from pagedserve.messages import SchedulerOutput as SO
from pagedserve.workers.worker import Worker

B = 4
PROMPT = [1, 17, 99, 4, 250, 31, 77, 8, 300, 41, 42, 5]
OTHER = [7, 8, 9, 10, 11]
SP = SamplingParams(temperature=0.0, logprobs=2)
BLOCKS = {"a": [[1, 2, 3, 4, 5]], "b": [[6, 7, 8]]}


@pytest.fixture(scope="module")
def worker_factory(checkpoint_dir):
    path = checkpoint_dir("llama")

    def make() -> Worker:
        w = Worker(EngineConfig(
            model=ModelConfig(model=str(path), dtype="float32"),
            cache=CacheConfig(block_size=B, kv_cache_memory_bytes=1 << 24),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
        ))
        w.load_model()
        w.init_kv_cache(KVCacheLayout(32, B, [[0, 1]]))
        return w

    return make


def _prefill(w: Worker) -> dict[str, list[int]]:
    new = [NewRequestData(r, p, [], SP, BLOCKS[r], 0) for r, p in (("a", PROMPT), ("b", OTHER))]
    out = w.execute(SO(0, new_reqs=new, num_scheduled_tokens={"a": 12, "b": 5}))
    return dict(zip(out.req_ids, out.sampled_token_ids, strict=True))


def _step_by_step(w: Worker, steps: int) -> tuple[list[int], list, list[int]]:
    """Greedy tokens and logprobs of "a" (and the tokens of "b"), one position per step."""
    first = _prefill(w)
    a, b = list(first["a"]), list(first["b"])
    lps = []
    for step in range(1, steps + 1):
        cached = CachedRequestData(["a", "b"], [[a[-1]], [b[-1]]], [None, None],
                                   [len(PROMPT) + step - 1, len(OTHER) + step - 1])
        out = w.execute(SO(step, cached_reqs=cached, num_scheduled_tokens={"a": 1, "b": 1}))
        got = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
        a += got["a"]
        b += got["b"]
        lps += out.logprobs[out.req_ids.index("a")]
    return a, lps, b


def test_draft_positions_sample_like_single_steps(worker_factory, checkpoint_dir, checkpoints):
    ref_a, ref_lps, ref_b = _step_by_step(worker_factory(), 4)  # a: 5 tokens, 4 logprobs
    assert ref_a == checkpoints.hf_greedy(checkpoints.load_hf_model(checkpoint_dir("llama")),
                                          PROMPT, 5)
    w = worker_factory()
    first = _prefill(w)
    assert first == {"a": ref_a[:1], "b": ref_b[:1]}
    # "a" verifies three drafts, the third wrong; "b" in the same step has none.
    wrong = (ref_a[3] + 1) % 512
    cached = CachedRequestData(["a", "b"], [ref_a[:1], ref_b[:1]], [None, None], [12, 5])
    out = w.execute(SO(1, cached_reqs=cached, num_scheduled_tokens={"a": 4, "b": 1},
                       draft_token_ids={"a": [ref_a[1], ref_a[2], wrong]}))
    got = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
    assert got == {"a": ref_a[1:4], "b": ref_b[1:2]}
    lps_a = out.logprobs[out.req_ids.index("a")]
    assert [ids for ids, _ in lps_a] == [ids for ids, _ in ref_lps[:3]]
    for (_, got_lp), (_, ref_lp) in zip(lps_a, ref_lps[:3], strict=True):
        assert got_lp == pytest.approx(ref_lp, abs=1e-4)
    # The next step writes over the rejected draft's slot and continues as if stepped singly.
    cached = CachedRequestData(["a", "b"], [ref_a[1:4], ref_b[1:2]], [None, None], [15, 6])
    out = w.execute(SO(2, cached_reqs=cached, num_scheduled_tokens={"a": 1, "b": 1}))
    got = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
    assert got == {"a": ref_a[4:5], "b": ref_b[2:3]}


def test_a_wrong_first_draft_keeps_one_token(worker_factory):
    expected_next = _step_by_step(worker_factory(), 1)[0][1]
    w = worker_factory()
    first = _prefill(w)["a"]
    cached = CachedRequestData(["a"], [first], [None], [12])
    draft = (expected_next + 1) % 512
    out = w.execute(SO(1, cached_reqs=cached, num_scheduled_tokens={"a": 3},
                       draft_token_ids={"a": [draft, 5]}))
    assert out.sampled_token_ids == [[expected_next]]
    assert len(out.logprobs[0]) == 1


def test_seeded_draft_positions_sample_like_single_steps(worker_factory):
    """A seeded row's noise is its position's: verifying drafts gives the tokens of stepping
    one position at a time, and a rejected draft's sample does not shift the next step's."""
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    new = NewRequestData("s", PROMPT, [], seeded, [[1, 2, 3, 4, 5]], 0)

    def step_by_step(w: Worker, steps: int) -> list[int]:
        out = w.execute(SO(0, new_reqs=[new], num_scheduled_tokens={"s": 12}))
        toks = list(out.sampled_token_ids[0])
        for step in range(1, steps + 1):
            cached = CachedRequestData(["s"], [[toks[-1]]], [None], [len(PROMPT) + step - 1])
            out = w.execute(SO(step, cached_reqs=cached, num_scheduled_tokens={"s": 1}))
            toks += out.sampled_token_ids[0]
        return toks

    ref = step_by_step(worker_factory(), 5)  # 6 tokens
    assert len(set(ref)) > 2  # it really samples
    w = worker_factory()
    out = w.execute(SO(0, new_reqs=[new], num_scheduled_tokens={"s": 12}))
    assert out.sampled_token_ids == [ref[:1]]
    wrong = (ref[4] + 1) % 512
    cached = CachedRequestData(["s"], [ref[:1]], [None], [12])
    out = w.execute(SO(1, cached_reqs=cached, num_scheduled_tokens={"s": 5},
                       draft_token_ids={"s": [ref[1], ref[2], ref[3], wrong]}))
    assert out.sampled_token_ids == [ref[1:5]]  # five positions sampled, four kept
    cached = CachedRequestData(["s"], [ref[1:5]], [None], [16])
    out = w.execute(SO(2, cached_reqs=cached, num_scheduled_tokens={"s": 1}))
    assert out.sampled_token_ids == [ref[5:6]]
