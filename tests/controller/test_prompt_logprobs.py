"""Prompt logprobs through the engine core: chunk by chunk, each position once, whatever the
prefix cache, preemption or ``n > 1`` do; and ``max_tokens=0`` (the prompt alone)."""

from __future__ import annotations

import pytest

from pagedserve.messages import ModelRunnerOutput, RequestDelta, SamplingParams, SchedulerOutput


def fake_logprob(pos: int, token: int) -> float:
    return -0.5 - 0.01 * (7 * pos + token % 13)


def expected(prompt: list[int], top: int = 0, vocab: int = 1000) -> list[dict[int, float] | None]:
    out: list[dict[int, float] | None] = [None]
    for p in range(1, len(prompt)):
        entry = {prompt[p]: fake_logprob(p, prompt[p])}
        for j in range(top):
            entry.setdefault((prompt[p] + 1 + j) % vocab, -0.1 * (j + 1))
        out.append(entry)
    return out


@pytest.fixture
def scoring(kit):
    """A fake executor that also scores prompt positions, as the worker does: the positions
    computed this step whose next token is still a prompt token, for rows that hold no output
    token yet. ``scored`` counts how often each (request, position) was scored."""

    class ScoringExecutor(kit.FakeExecutor):
        def __post_init__(self) -> None:
            super().__post_init__()
            self.scored: dict[tuple[str, int], int] = {}

        def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
            out = super().execute(so)
            for rid, n in so.num_scheduled_tokens.items():
                row = self.rows[rid]
                k = row.params.prompt_logprobs
                num_prompt = row.prompt_len
                if k is None or len(row.tokens) != num_prompt:
                    continue
                lo, hi = row.computed - n, min(row.computed, num_prompt - 1)
                if hi <= lo:
                    continue
                ids, lps = [], []
                for q in range(lo, hi):
                    t = row.tokens[q + 1]
                    alt = [(t + 1 + j) % self.vocab_size for j in range(k)]
                    ids.append([t, *alt])
                    lps.append([fake_logprob(q + 1, t), *(-0.1 * (j + 1) for j in range(k))])
                    self.scored[(rid, q + 1)] = self.scored.get((rid, q + 1), 0) + 1
                if out.prompt_logprobs is None:
                    out.prompt_logprobs = {}
                out.prompt_logprobs[rid] = (lo + 1, ids, lps)
            return out

    return ScoringExecutor


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 17) % 997 + 3 for i in range(n)]


def _raw_steps(eng) -> list[RequestDelta]:
    deltas: list[RequestDelta] = []
    while eng.has_unfinished():
        deltas.extend(eng.core.step())
        eng.kv.check_integrity()
    return deltas


def test_chunked_prefill_sends_each_position_once(kit, scoring):
    eng = kit.make_engine(executor=scoring(), max_num_batched_tokens=8)
    prompt = _prompt(1, 30)
    eng.add_request("a", prompt, SamplingParams(max_tokens=3, prompt_logprobs=2))
    eng.add_request("plain", _prompt(2, 12), SamplingParams(max_tokens=3))
    deltas = _raw_steps(eng)
    mine = [d for d in deltas if d.request_id == "a" and d.prompt_logprobs]
    assert len(mine) >= 4  # 30 prompt tokens, 8 per step: it came out chunk by chunk
    assert sum((d.prompt_logprobs for d in mine), []) == expected(prompt, 2)
    assert all(d.prompt_logprobs is None for d in deltas if d.request_id == "plain")
    kit.assert_idle(eng)


def test_accumulated_output_and_short_prompts(kit, scoring):
    eng = kit.make_engine(executor=scoring())
    long_prompt = _prompt(3, 21)
    eng.add_request("a", long_prompt, SamplingParams(max_tokens=4, prompt_logprobs=0))
    eng.add_request("one", [5], SamplingParams(max_tokens=2, prompt_logprobs=3))
    eng.add_request("none", _prompt(4, 9), SamplingParams(max_tokens=2))
    done = kit.run(eng)
    assert done["a"].prompt_logprobs == expected(long_prompt)
    assert done["one"].prompt_logprobs == [None]
    assert done["none"].prompt_logprobs is None
    assert len(done["a"].outputs[0].token_ids) == 4


def test_prefix_hit_does_not_lose_them(kit, scoring):
    eng = kit.make_engine(executor=scoring(), block_size=4)
    prompt = _prompt(5, 26)
    eng.add_request("warm", prompt, SamplingParams(max_tokens=2))
    kit.run(eng)
    eng.add_request("again", prompt, SamplingParams(max_tokens=2, prompt_logprobs=1))
    out = kit.run(eng)["again"]
    assert out.prompt_logprobs == expected(prompt, 1)
    assert out.num_cached_tokens == 0  # computed from the start, despite the warm prefix
    # Its blocks are cached for others all the same.
    other = _prompt(6, 18)
    eng.add_request("scored-first", other, SamplingParams(max_tokens=2, prompt_logprobs=0))
    kit.run(eng)
    eng.add_request("then-plain", other, SamplingParams(max_tokens=2))
    assert kit.run(eng)["then-plain"].num_cached_tokens == 16
    kit.assert_idle(eng)


def test_preemption_neither_duplicates_nor_loses(kit, scoring):
    fake = scoring()
    # 12 usable blocks of 4 tokens for four requests that want 10 at their peak: preemptions.
    eng = kit.make_engine(executor=fake, num_gpu_blocks=13, block_size=4, max_num_batched_tokens=6)
    prompts = {f"r{i}": _prompt(10 + i, 24 + i) for i in range(4)}
    for rid, p in prompts.items():
        eng.add_request(rid, p, SamplingParams(max_tokens=14, prompt_logprobs=1, ignore_eos=True))
    deltas = _raw_steps(eng)
    assert eng.scheduler.num_preemptions > 0
    for rid, p in prompts.items():
        sent = [e for d in deltas if d.request_id == rid for e in (d.prompt_logprobs or [])]
        assert sent == expected(p, 1), rid
    # Some prompt positions were computed again after a preemption, and dropped as known.
    assert max(fake.scored.values()) > 1
    kit.assert_idle(eng)


@pytest.mark.parametrize("policy", ["paged", "reserve"])
def test_parallel_sampling_has_them_once(kit, scoring, policy):
    eng = kit.make_engine(executor=scoring(), allocation_policy=policy, num_gpu_blocks=None)
    prompt = _prompt(7, 19)
    eng.add_request("n3", prompt, SamplingParams(n=3, max_tokens=4, seed=1, prompt_logprobs=2))
    deltas = _raw_steps(eng)
    sent = [e for d in deltas if d.request_id == "n3" for e in (d.prompt_logprobs or [])]
    assert sent == expected(prompt, 2)


def test_max_tokens_zero_is_the_prompt_alone(kit, scoring):
    eng = kit.make_engine(executor=scoring(), max_num_batched_tokens=8)
    prompt = _prompt(8, 13)
    eng.add_request("score", prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))
    eng.add_request("score-n2", prompt, SamplingParams(n=2, max_tokens=0, prompt_logprobs=0))
    eng.add_request("plain", prompt, SamplingParams(max_tokens=0))
    done = kit.run(eng)
    for rid in ("score", "score-n2"):
        assert done[rid].prompt_logprobs == expected(prompt)
    for out in done.values():
        assert out.finished
        assert all(c.token_ids == [] and c.finish_reason == "length" for c in out.outputs)
    assert len(done["score-n2"].outputs) == 2
    kit.assert_idle(eng)


def test_abort_midway_is_clean(kit, scoring):
    eng = kit.make_engine(executor=scoring(), max_num_batched_tokens=4)
    eng.add_request("a", _prompt(9, 30), SamplingParams(max_tokens=5, prompt_logprobs=0))
    eng.step()
    eng.step()
    out = eng.abort_request("a")
    assert out is not None and out.finished
    assert out.prompt_logprobs is not None and 1 < len(out.prompt_logprobs) < 30
    kit.assert_idle(eng)
