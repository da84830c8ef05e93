"""The tokens-per-step histogram: counted by the scheduler, exported on ``/metrics``."""

from __future__ import annotations

from typing import Any

from pagedserve.benchmarks.prom import histogram_quantile, parse_metrics
from pagedserve.controller.engine_stats import BATCHED_TOKENS_BUCKETS
from pagedserve.controller.request import Request
from pagedserve.controller.scheduler import Scheduler
from pagedserve.kv import KVCacheManager
from pagedserve.messages import ModelRunnerOutput, SamplingParams
from pagedserve.serving.openai.metrics import ServerMetrics


def _run(num_reqs: int, prompt: int, out: int) -> Scheduler:
    kv = KVCacheManager(None, 200, 16, 512, enable_caching=False)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=16, max_model_len=512)
    for i in range(num_reqs):
        s.add_request(Request(f"r{i}", [5] * prompt, SamplingParams(max_tokens=out)))
    while s.has_unfinished():
        so = s.schedule()
        done = [r for r in so.num_scheduled_tokens if s.requests[r].num_computed_tokens
                == s.requests[r].num_tokens]
        s.update_from_output(so, ModelRunnerOutput(so.step_id, done, [[9]] * len(done)))
    return s


def test_scheduler_counts_tokens_per_step() -> None:
    s = _run(num_reqs=4, prompt=40, out=5)
    st = s.stats()
    assert len(st.batched_tokens_counts) == len(BATCHED_TOKENS_BUCKETS) + 1
    # Prefill 160 tokens with a 64-token budget: 64, 64, 32 (+ the 4 first decodes); then 4
    # decode steps of 4 tokens each.
    assert st.batched_tokens_sum == 4 * 40 + 4 * 4
    assert sum(st.batched_tokens_counts) == st.num_steps


class _Client:
    def __init__(self, stats: dict[str, Any]) -> None:
        self._stats = stats

    def stats(self) -> dict[str, Any]:
        return self._stats

    def is_healthy(self) -> bool:
        return True


def test_histogram_is_exported_and_parsed() -> None:
    from dataclasses import asdict

    s = _run(num_reqs=6, prompt=10, out=20)
    stats = asdict(s.stats())
    text = ServerMetrics(_Client(stats)).render().decode()  # type: ignore[arg-type]
    assert 'pagedserve_batched_tokens_per_step_bucket{le="6"}' in text
    m = parse_metrics(text)
    hist = m.histogram("pagedserve_batched_tokens_per_step")
    assert hist.count == s.stats().num_steps
    assert hist.sum == stats["batched_tokens_sum"]
    # Mostly 6-token decode steps: the median lies in the (4, 6] bucket.
    assert 4 < histogram_quantile(hist, 0.5) <= 6
    assert 5 <= histogram_quantile(hist, 0.5, integer=True) <= 6
