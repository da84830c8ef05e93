"""The serving experiment's numbers: per-rate summaries of the request results, histogram
summaries, and the highest rate a policy sustains under the latency SLO."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedserve.benchmarks.prom import Histogram, histogram_quantile

__all__ = [
    "BATCHED_TOKENS", "PREEMPTIONS", "STEPS", "RequestResult", "capacity", "hist_summary",
    "meets", "summarise",
]

BATCHED_TOKENS = "pagedserve_batched_tokens_per_step"
PREEMPTIONS = "pagedserve_num_preemptions_total"
STEPS = "pagedserve_engine_steps_total"
MULTI_PASS_STEPS = "pagedserve_engine_multi_pass_steps_total"


@dataclass
class RequestResult:
    prompt_tokens: int
    max_tokens: int
    send: float = 0.0
    ttft: float = math.nan
    e2e: float = math.nan
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_tokens > 0



def _pct(xs: list[float] | np.ndarray, q: float) -> float:
    a = np.asarray(xs, dtype=float)
    a = a[np.isfinite(a)]
    return float(np.percentile(a, q)) if a.size else math.nan


def _mean(xs: list[float] | np.ndarray) -> float:
    a = np.asarray(xs, dtype=float)
    a = a[np.isfinite(a)]
    return float(a.mean()) if a.size else math.nan


def summarise(rate: float, results: list[RequestResult], t0: float, t_end: float, peak: int,
               before: Any, during: Any, after: Any) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    e2e = [r.e2e for r in ok]
    ttft = [r.ttft for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    norm = [r.e2e / r.output_tokens for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    duration = max(1e-9, (max(r.send + r.e2e for r in ok) - t0) if ok else t_end - t0)
    first = before.histogram(BATCHED_TOKENS)
    whole: Histogram = after.histogram(BATCHED_TOKENS).minus(first)
    load: Histogram = during.histogram(BATCHED_TOKENS).minus(first)
    return {
        "rate": rate,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "peak_concurrency": peak,
        "e2e_mean": _mean(e2e), "e2e_p50": _pct(e2e, 50), "e2e_p99": _pct(e2e, 99),
        "normalized_latency_mean": _mean(norm),
        "normalized_latency_p50": _pct(norm, 50),
        "normalized_latency_p99": _pct(norm, 99),
        "ttft_mean": _mean(ttft), "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
        "tpot_mean": _mean(tpot), "tpot_p50": _pct(tpot, 50), "tpot_p99": _pct(tpot, 99),
        "itl_p50": _pct(itl, 50), "itl_p99": _pct(itl, 99),
        "sse_events_per_output_token": (
            (len(itl) + len(ok)) / out_tokens if out_tokens else math.nan),
        "preemptions": after.value(PREEMPTIONS) - before.value(PREEMPTIONS),
        "engine_steps": after.value(STEPS) - before.value(STEPS),
        # Steps of several decode passes: their samples after the first were not scheduled.
        "multi_pass_steps": after.value(MULTI_PASS_STEPS) - before.value(MULTI_PASS_STEPS),
        # While requests were still arriving (under load), and over the whole run (drain too).
        "batched_tokens": hist_summary(load),
        "batched_tokens_whole_run": hist_summary(whole),
        "requests": [
            {"prompt": r.prompt_tokens, "output": r.output_tokens, "ttft": r.ttft,
             "e2e": r.e2e, "error": r.error}
            for r in results
        ],
    }


def hist_summary(h: Histogram) -> dict[str, Any]:
    return {
        "steps": h.count,
        "mean": h.sum / h.count if h.count else math.nan,
        "p10": histogram_quantile(h, 0.1, integer=True),
        "median": histogram_quantile(h, 0.5, integer=True),
        "p90": histogram_quantile(h, 0.9, integer=True),
        "bounds": h.bounds,
        "counts": h.counts(),
    }


# --------------------------------------------------------------------------- servers
def meets(row: dict[str, Any], slo: float) -> bool:
    lat = row["normalized_latency_mean"]
    return row["failed"] == 0 and lat is not None and math.isfinite(lat) and lat <= slo


def capacity(rows: list[dict[str, Any]], slo: float) -> dict[str, Any]:
    """Highest swept rate up to which every rate meets the SLO (and completes every request),
    and a linear interpolation to the crossing point."""
    best = None
    crossing = None
    prev = None
    for r in sorted(rows, key=lambda r: r["rate"]):
        lat = r["normalized_latency_mean"]
        if not meets(r, slo):
            if prev is not None and math.isfinite(lat):
                r0, l0 = prev["rate"], prev["normalized_latency_mean"]
                crossing = r0 + (slo - l0) * (r["rate"] - r0) / max(1e-12, lat - l0)
            break
        best, prev = r["rate"], r
    return {
        "max_rate_meeting_slo": best,
        "interpolated": crossing if crossing is not None else best,
        "bounded": crossing is not None,
        "note": None if crossing is not None else (
            "no swept rate violated the SLO: the capacity is at least the highest rate"
            if best is not None else "even the lowest rate violated the SLO"),
    }


