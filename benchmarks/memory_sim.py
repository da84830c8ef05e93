"""One memory experiment: the real scheduler and KV manager driven by a no-compute executor.

``simulate(SimConfig)`` replays a workload (Poisson arrivals, synthetic lengths) through
``controller.scheduler.Scheduler`` over a ``kv.KVCacheManager`` under one allocation policy.
The executor computes nothing: every sequence whose scheduled tokens reach its end "samples" a
made-up token at once, so thousands of requests take seconds. Time is simulated: a step lasts
``step_base_s + step_per_token_s * batched tokens`` (a rough GPU step model that only orders
arrivals against steps; no latency measured here means anything).

Each step, at the moment the step's blocks are allocated (after ``schedule()``), it records
``kv.block_fill_snapshot()``: tokens held per physical block. From it come the utilisation
(slots holding tokens / slots in allocated blocks), the waste split of the paper's Fig. 2,
the sharing savings of its Fig. 15 and the block-fill heatmap.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedserve.benchmarks.contiguous import ContiguousReserveManager
from pagedserve.benchmarks.workloads import WORKLOADS, arrival_times, next_pow2, sample_lengths
from pagedserve.controller.request import Request, request_group, sequence_ids
from pagedserve.controller.scheduler import Scheduler
from pagedserve.kv import BlockHasher, KVCacheManager
from pagedserve.messages import ModelRunnerOutput, SamplingParams

__all__ = ["POLICIES", "EXECUTOR_NOTE", "Policy", "SimConfig", "SimResult", "simulate"]

EXECUTOR_NOTE = (
    "no-compute executor: the real Scheduler and KVCacheManager run; token ids are made up, "
    "no model runs and nothing is computed; time is simulated by a step-cost model"
)


@dataclass(frozen=True)
class Policy:
    name: str
    label: str
    kv_policy: str
    """``paged`` or ``reserve`` (the KV manager's policy)."""
    reserve: str | None = None
    """For ``reserve``: ``max`` (max_model_len), ``oracle`` (the true length) or ``pow2``."""


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("paged", "vLLM-style, blocks on demand", "paged"),
        Policy("reserve", "Orca-Max: reserves max_model_len", "reserve", "max"),
        Policy("reserve-pow2", "Orca-Pow2: reserves the length's next power of two", "reserve",
               "pow2"),
        Policy("reserve-oracle", "Orca-Oracle: reserves the true length", "reserve", "oracle"),
    )
}


def _true_length(r: Any) -> int:
    max_tokens = r.sampling_params.max_tokens
    return int(r.num_prompt_tokens + (max_tokens if max_tokens is not None else 0))


_RESERVE_FNS: dict[str, Callable[[Any], int] | None] = {
    "max": None,
    "oracle": _true_length,
    "pow2": lambda r: next_pow2(_true_length(r)),
}


@dataclass
class SimConfig:
    workload: str = "sharegpt"
    policy: str = "paged"
    num_requests: int = 1000
    rate: float = 30.0
    """Requests per second (simulated time); ``inf`` sends all at 0."""
    block_size: int = 16
    kv_tokens: int = 32768
    """Token slots in the pool (the fixed KV budget): ``kv_tokens // block_size`` blocks."""
    max_model_len: int = 2048
    max_num_seqs: int = 2048
    max_num_batched_tokens: int = 2048
    n: int = 1
    """Parallel samples per request (forked, sharing the prompt's blocks)."""
    system_prompt_len: int = 0
    """Tokens of one prompt prefix every request shares (prefix caching shares its blocks)."""
    enable_caching: bool = False
    contiguous: bool = True
    """Reservation policies must fit a contiguous run of blocks (see ``contiguous.py``)."""
    step_base_s: float = 0.010
    step_per_token_s: float = 2e-5
    heatmap_rows: int = 0
    """Keep about this many block-fill snapshots, evenly spaced in steps (0: none)."""
    heatmap_until_s: float = math.inf
    """Snapshots only up to this simulated time (so that two policies cover the same span)."""
    series_points: int = 600
    seed: int = 0


@dataclass
class SimResult:
    config: SimConfig
    summary: dict[str, Any]
    series: dict[str, list[float]]
    frag_steady: np.ndarray
    heatmap: np.ndarray | None = None
    heatmap_t: list[float] = field(default_factory=list)


def _make_kv(cfg: SimConfig, policy: Policy, num_blocks: int) -> KVCacheManager:
    if policy.kv_policy == "paged":
        return KVCacheManager(
            None, num_blocks, cfg.block_size, cfg.max_model_len, enable_caching=cfg.enable_caching
        )
    assert policy.reserve is not None
    fn = _RESERVE_FNS[policy.reserve]
    if cfg.contiguous:
        return ContiguousReserveManager(num_blocks, cfg.block_size, cfg.max_model_len, fn)
    return KVCacheManager(
        None, num_blocks, cfg.block_size, cfg.max_model_len,
        enable_caching=cfg.enable_caching, policy="reserve", reserve_tokens=fn,
    )


class _Decimator:
    """Keeps every ``stride``-th item, doubling the stride whenever twice ``target`` are kept."""

    def __init__(self, target: int) -> None:
        self.target = max(1, target)
        self.stride = 1
        self.items: list[Any] = []
        self._i = 0

    def offer(self, make: Callable[[], Any]) -> None:
        if self._i % self.stride == 0:
            self.items.append(make())
            if len(self.items) >= 2 * self.target:
                self.items = self.items[::2]
                self.stride *= 2
        self._i += 1


def simulate(cfg: SimConfig, progress: Callable[[int], None] | None = None) -> SimResult:
    """Run one workload under one policy; ``progress(k)`` is called as k requests finish."""
    policy = POLICIES[cfg.policy]
    workload = WORKLOADS[cfg.workload]
    rng = np.random.default_rng(cfg.seed)
    bs = cfg.block_size
    num_blocks = cfg.kv_tokens // bs + 1  # + the null block
    kv = _make_kv(cfg, policy, num_blocks)
    sched = Scheduler(
        kv,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
        max_model_len=cfg.max_model_len,
        eos_token_ids=(),
    )
    hasher = BlockHasher(kv.block_size) if cfg.enable_caching else None
    room = cfg.max_model_len - cfg.system_prompt_len
    prompts, outputs = sample_lengths(workload, cfg.num_requests, rng, max_total=room)
    arrivals = arrival_times(cfg.num_requests, cfg.rate, rng)
    system = rng.integers(10, 30000, size=cfg.system_prompt_len).tolist()
    vocab_rng = np.random.default_rng(cfg.seed + 1)

    def make_request(i: int) -> Request:
        ids = system + vocab_rng.integers(10, 30000, size=int(prompts[i])).tolist()
        params = SamplingParams(max_tokens=int(outputs[i]), ignore_eos=True, n=cfg.n)
        arrival = float(arrivals[i])
        return request_group(f"r{i}", ids, params, hasher=hasher, arrival_time=arrival)[0]

    final_len: dict[str, int] = {}  # slots a sequence ever writes: prompt + output - 1
    for i in range(cfg.num_requests):
        f = cfg.system_prompt_len + int(prompts[i]) + int(outputs[i]) - 1
        final_len.update(dict.fromkeys(sequence_ids(f"r{i}", cfg.n), f))

    usable_slots = kv.pool.num_usable_blocks * bs
    steady_lo = float(arrivals[min(cfg.num_requests - 1, cfg.num_requests // 10)])
    steady_hi = float(arrivals[-1])
    blocks_of = kv.managers[0].req_to_blocks
    contiguous = isinstance(kv, ContiguousReserveManager)

    # Time-weighted accumulators over the steady window (and over the whole run for util).
    acc = {k: 0.0 for k in ("dt", "tokens", "reserved", "internal", "external", "free",
                            "alloc", "seq_alloc_slots", "seqs", "with_share",
                            "without_share", "waiting_steps", "steps")}
    all_dt = all_tokens = all_alloc = 0.0
    frag: list[float] = []
    series = _Decimator(cfg.series_points)
    heat = _Decimator(cfg.heatmap_rows) if cfg.heatmap_rows else None
    max_running = 0
    num_finished = 0
    clock = 0.0
    nxt = 0
    step = 0
    while nxt < cfg.num_requests or sched.has_unfinished():
        while nxt < cfg.num_requests and arrivals[nxt] <= clock:
            sched.add_request(make_request(nxt))
            nxt += 1
        if not sched.has_unfinished():
            clock = float(arrivals[nxt])
            continue
        out = sched.schedule()
        total = out.total_num_scheduled_tokens
        if total == 0:
            raise RuntimeError(
                f"step {step}: nothing scheduled with {len(sched.waiting)} waiting and "
                f"{len(sched.running)} running (a request larger than the KV pool?)"
            )
        dt = cfg.step_base_s + cfg.step_per_token_s * total

        # --- the step hook moment: blocks allocated for this step, none freed yet ---
        fill = kv.block_fill_snapshot()
        tokens = int(fill.sum())
        in_use = kv.pool.num_usable_blocks - kv.num_free_blocks
        alloc = in_use * bs
        seqs = 0
        reserved = internal = without = 0
        for r in sched.running:
            mult = len(r.children) or 1
            seqs += mult
            t = r.num_computed_tokens
            without += mult * -(-t // bs)
            a = len(blocks_of[r.request_id]) * bs
            f = final_len.get(r.request_id, t)
            reserved += max(0, min(a, f) - t)
            internal += max(0, a - max(f, t))
        max_running = max(max_running, seqs)
        free_slots = usable_slots - alloc
        external = 0
        if contiguous and sched.waiting:
            need = kv.reservation_blocks(sched.waiting[0])  # type: ignore[attr-defined]
            external = kv.external_fragmentation_blocks(need) * bs  # type: ignore[attr-defined]
        util = tokens / alloc if alloc else 1.0
        all_dt += dt
        all_tokens += tokens * dt
        all_alloc += alloc * dt
        if steady_lo <= clock <= steady_hi:
            acc["dt"] += dt
            acc["tokens"] += tokens * dt
            acc["reserved"] += reserved * dt
            acc["internal"] += internal * dt
            acc["external"] += external * dt
            acc["free"] += (free_slots - external) * dt
            acc["alloc"] += alloc * dt
            acc["seqs"] += seqs * dt
            acc["with_share"] += in_use * dt
            acc["without_share"] += without * dt
            acc["steps"] += 1
            acc["waiting_steps"] += 1 if sched.waiting else 0
            if alloc:
                frag.append(1.0 - util)
        waiting = len(sched.waiting)
        series.offer(lambda c=clock, u=util, s=seqs, w=waiting, a=alloc: (
            c, u, s, w, a / usable_slots))
        if heat is not None and clock <= cfg.heatmap_until_s:
            heat.offer(lambda c=clock, f=fill: (c, _heat_row(kv, f)))

        # --- the executor: nothing computed, one made-up token per finished sequence ---
        req_ids: list[str] = []
        toks: list[list[int]] = []
        for rid in out.num_scheduled_tokens:
            r = sched.requests.get(rid)
            if r is None or r.children or r.num_computed_tokens != r.num_tokens:
                continue
            req_ids.append(rid)
            toks.append([10 + (r.index * 7919 + r.num_tokens * 104729) % 29990])
        for r in sched.update_from_output(out, ModelRunnerOutput(out.step_id, req_ids, toks)):
            if r.is_finished:
                num_finished += 1
                if progress is not None:
                    progress(1)
        clock += dt
        step += 1

    d = acc["dt"] or 1.0
    lengths = prompts + outputs + cfg.system_prompt_len
    summary: dict[str, Any] = {
        "policy": policy.name,
        "label": policy.label,
        "workload": cfg.workload,
        "block_size": bs,
        "num_blocks": num_blocks - 1,
        "kv_token_slots": usable_slots,
        "num_requests": cfg.num_requests,
        "n": cfg.n,
        "steps": step,
        "steady_steps": int(acc["steps"]),
        "steady_window_s": [steady_lo, steady_hi],
        "steady_share_of_steps_with_waiting": acc["waiting_steps"] / max(1.0, acc["steps"]),
        "simulated_duration_s": clock,
        "finished_sequences": num_finished,
        "preemptions": sched.num_preemptions,
        "max_concurrent_sequences": max_running,
        "mean_concurrent_sequences": acc["seqs"] / d,
        # token slots holding tokens / slots of allocated blocks, time-weighted
        "utilisation_steady": acc["tokens"] / acc["alloc"] if acc["alloc"] else math.nan,
        "utilisation_whole_run": all_tokens / all_alloc if all_alloc else math.nan,
        "fragmentation_steady": _percentiles(frag),
        # shares of the whole pool (the paper's Fig. 2), time-weighted over the steady window
        "pool_shares_steady": {
            "token_states": acc["tokens"] / d / usable_slots,
            "reservation": acc["reserved"] / d / usable_slots,
            "internal_fragmentation": acc["internal"] / d / usable_slots,
            "external_fragmentation": acc["external"] / d / usable_slots,
            "free": acc["free"] / d / usable_slots,
        },
        "mean_allocated_slots_per_sequence": (acc["alloc"] / acc["seqs"]) if acc["seqs"] else 0,
        "sharing_saving": (
            1.0 - acc["with_share"] / acc["without_share"] if acc["without_share"] else 0.0
        ),
        "request_length": {
            "mean": float(lengths.mean()),
            "p50": float(np.percentile(lengths, 50)),
            "p95": float(np.percentile(lengths, 95)),
            "prompt_mean": float(prompts.mean()) + cfg.system_prompt_len,
            "output_mean": float(outputs.mean()),
        },
    }
    cols = list(zip(*series.items, strict=True)) if series.items else [[]] * 5
    result = SimResult(
        cfg,
        summary,
        {
            "t": list(cols[0]),
            "utilisation": list(cols[1]),
            "running": list(cols[2]),
            "waiting": list(cols[3]),
            "pool_allocated": list(cols[4]),
        },
        np.asarray(frag, dtype=np.float32),
    )
    if heat is not None and heat.items:
        result.heatmap_t = [c for c, _ in heat.items]
        result.heatmap = np.stack([f for _, f in heat.items])
    return result


def _heat_row(kv: KVCacheManager, fill: np.ndarray) -> np.ndarray:
    """Tokens per block, -1 for a block no request holds (free, maybe cached)."""
    row = fill.astype(np.int16)
    held = np.fromiter((b.ref_cnt > 0 for b in kv.pool.blocks), dtype=bool, count=row.size)
    row[~held] = -1
    return row


def _percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {k: math.nan for k in ("mean", "p5", "p50", "p95", "max")}
    a = np.asarray(xs)
    return {
        "mean": float(a.mean()),
        "p5": float(np.percentile(a, 5)),
        "p50": float(np.percentile(a, 50)),
        "p95": float(np.percentile(a, 95)),
        "max": float(a.max()),
    }
