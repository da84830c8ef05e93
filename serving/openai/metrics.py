"""Prometheus metrics of one API server, in a registry of its own.

Engine-side numbers (running and waiting requests, KV usage, prefix-cache queries and hits,
preemptions) are read from ``EngineClient.stats()`` at scrape time by a custom collector, so
they are never stale and need no polling thread. Server-side numbers (token counters, request
outcomes, latency histograms) are recorded as requests progress.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from pagedserve.controller.client import EngineClient
from pagedserve.controller.engine_stats import BATCHED_TOKENS_BUCKETS

__all__ = ["PREFIX", "ServerMetrics"]

logger = logging.getLogger(__name__)

PREFIX = "pagedserve_"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)

# stats() key -> (metric name without prefix, help, kind)
_ENGINE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("num_running", "num_requests_running", "Requests being computed in the batch.", "gauge"),
    ("num_waiting", "num_requests_waiting", "Requests waiting to be scheduled.", "gauge"),
    ("kv_usage", "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", "gauge"),
    ("kv_blocks_used", "kv_cache_blocks_used", "KV-cache blocks in use.", "gauge"),
    ("kv_blocks_total", "kv_cache_blocks_total", "KV-cache blocks in the pool.", "gauge"),
    ("kv_capacity_tokens", "kv_cache_capacity_tokens",
     "Tokens the KV pool holds (blocks x block size).", "gauge"),
    ("kv_cache_bytes", "kv_cache_bytes", "Bytes of one rank's KV pool.", "gauge"),
    ("kv_cache_element_bytes", "kv_cache_element_bytes",
     "Bytes per KV element: the KV cache dtype's (4 float32, 2 bfloat16, 1 fp8_e4m3).",
     "gauge"),
    ("prefix_cache_queries", "prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache.", "counter"),
    ("prefix_cache_hits", "prefix_cache_hits",
     "Prompt tokens found in the prefix cache.", "counter"),
    ("prefix_cache_device_hits", "prefix_cache_device_hits",
     "Prompt tokens found in the device tier of the prefix cache.", "counter"),
    ("prefix_cache_host_hits", "prefix_cache_host_hits",
     "Prompt tokens found in the host tier (copied back instead of recomputed).", "counter"),
    ("num_preemptions", "num_preemptions",
     "Requests preempted (by swap or by recompute).", "counter"),
    ("num_swapped", "num_requests_swapped",
     "Preempted requests waiting with their KV in the host tier.", "gauge"),
    ("kv_host_blocks_used", "kv_host_cache_blocks_used",
     "Host-tier KV blocks held by swapped requests or this step's copies.", "gauge"),
    ("kv_host_blocks_total", "kv_host_cache_blocks_total", "Host-tier KV blocks.", "gauge"),
    ("kv_host_swap_outs", "kv_host_swap_outs", "Requests preempted by swapping.", "counter"),
    ("kv_host_swap_ins", "kv_host_swap_ins", "Swapped requests resumed.", "counter"),
    ("kv_host_swap_fallbacks", "kv_host_swap_fallbacks",
     "Swap preemptions that fell back to recompute (host tier full).", "counter"),
    ("kv_host_offloaded_blocks", "kv_host_offloaded_blocks",
     "Cached blocks evicted from the device and kept in the host tier.", "counter"),
    ("kv_host_blocks_to_host", "kv_host_blocks_copied_to_host",
     "Device -> host block copies (swap-outs and offloads).", "counter"),
    ("kv_host_blocks_to_device", "kv_host_blocks_copied_to_device",
     "Host -> device block copies (swap-ins and host prefix hits).", "counter"),
    ("num_steps", "engine_steps", "Engine steps run.", "counter"),
    ("num_multi_pass_steps", "engine_multi_pass_steps",
     "Engine steps that ran several decode passes (a small batch, num_scheduler_steps).",
     "counter"),
    ("num_overlapped_steps", "engine_overlapped_steps",
     "Engine steps scheduled while the step before them ran (async scheduling).", "counter"),
    ("num_worker_restarts", "worker_group_restarts",
     "Worker groups rebuilt after a failure (their requests resumed).", "counter"),
    ("num_controller_restarts", "controller_restarts",
     "Controllers started after one was lost (Ray backend).", "counter"),
    ("num_requests_moved", "requests_moved",
     "Requests moved off a lost controller and resumed elsewhere (Ray backend).", "counter"),
    ("time_grammar_mask_s", "grammar_mask_seconds",
     "Time the controller spent computing structured-output token masks.", "counter"),
    ("num_grammar_mask_steps", "grammar_mask_steps",
     "Engine steps that computed structured-output token masks.", "counter"),
    ("spec_decode_num_drafts", "spec_decode_num_drafts",
     "Request-steps that verified speculative drafts.", "counter"),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens",
     "Draft tokens proposed and verified.", "counter"),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
     "Draft tokens accepted.", "counter"),
    ("kv_integrity_ok", "kv_cache_integrity_ok",
     "1 if the KV manager's invariants held (and every block was free) at the last idle check.",
     "gauge"),
    ("kv_integrity_checks", "kv_cache_integrity_checks",
     "KV-manager integrity checks run (one per idle spell of the engine).", "counter"),
)


# Counted by the Ray front end (``cluster.router``); an in-process engine has no controller
# to lose, so they read 0 there rather than being absent.
_FRONT_END_COUNTERS = frozenset({"num_controller_restarts", "num_requests_moved"})


class _EngineCollector(Collector):
    """Reads the engine's counters when Prometheus scrapes."""

    def __init__(self, client: EngineClient) -> None:
        self._client = client

    def collect(self) -> Iterator[Metric]:
        try:
            stats: dict[str, Any] = self._client.stats()
        except Exception:  # a dead remote engine must not break /metrics
            logger.warning("engine stats unavailable", exc_info=True)
            stats = {}
        healthy = GaugeMetricFamily(PREFIX + "engine_healthy", "1 if the engine is serving.")
        try:
            healthy.add_metric([], 1.0 if self._client.is_healthy() else 0.0)
        except Exception:
            healthy.add_metric([], 0.0)
        yield healthy
        for key, name, doc, kind in _ENGINE_METRICS:
            value = stats.get(key, 0 if key in _FRONT_END_COUNTERS else None)
            if value is None:
                continue
            family: Metric
            if kind == "counter":
                family = CounterMetricFamily(PREFIX + name, doc)
            else:
                family = GaugeMetricFamily(PREFIX + name, doc)
            family.add_metric([], float(value))
            yield family
        per_pos = [(key.rsplit("_", 1)[1], value) for key, value in stats.items()
                   if key.startswith("spec_decode_num_accepted_tokens_pos_")]
        if per_pos:
            family = CounterMetricFamily(
                PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by position in their run (0: the first draft).",
                labels=["position"],
            )
            for position, value in per_pos:
                family.add_metric([position], float(value))
            yield family
        counts = stats.get("batched_tokens_counts")
        if counts and len(counts) == len(BATCHED_TOKENS_BUCKETS) + 1:
            cumulative, buckets = 0, []
            for bound, count in zip((*BATCHED_TOKENS_BUCKETS, "+Inf"), counts, strict=True):
                cumulative += int(count)
                buckets.append((str(bound), float(cumulative)))
            yield HistogramMetricFamily(
                PREFIX + "batched_tokens_per_step",
                "Tokens scheduled in one engine step (prefill chunks and decodes together).",
                buckets=buckets,
                sum_value=float(stats.get("batched_tokens_sum", 0)),
            )


class ServerMetrics:
    """Every metric of one app, registered in a private ``CollectorRegistry``."""

    def __init__(self, client: EngineClient) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(client))
        r = self.registry
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of admitted requests.", registry=r
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated.", registry=r
        )
        self.requests = Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason (stop, length, abort, error).",
            ["finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time between generated tokens, per request.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between two outputs of a request, per generated token.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        # Read at scrape time; the app points them at its counters (build_app).
        self.interactive_in_flight = Gauge(
            PREFIX + "interactive_requests_in_flight",
            "Interactive API calls in progress (the Batch API's lines not counted).",
            registry=r,
        )
        self.batch_in_flight = Gauge(
            PREFIX + "batch_requests_in_flight", "Batch API lines in the engine.", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def record_finished(
        self,
        finish_reasons: list[str | None],
        arrival: float,
        first_token: float | None,
        end: float,
        max_output_tokens: int,
    ) -> None:
        """One engine request is done: count its outcome and observe its latencies."""
        for reason in finish_reasons:
            self.requests.labels(finished_reason=reason or "abort").inc()
        self.e2e.observe(max(0.0, end - arrival))
        if first_token is not None and max_output_tokens > 1:
            self.tpot.observe(max(0.0, (end - first_token) / (max_output_tokens - 1)))
