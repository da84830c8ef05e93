"""``pagedserve bench memory``: how much of the KV cache holds tokens under each policy.

Experiments (each a :func:`pagedserve.benchmarks.memory_sim.simulate` run):

* policies: ``paged`` against ``reserve`` (Orca-Max), ``reserve-pow2`` (Orca-Pow2) and
  ``reserve-oracle`` (Orca-Oracle) under one fixed KV budget, ShareGPT-like and Alpaca-like
  lengths, Poisson arrivals fast enough to keep the cache full;
* parallel sampling (n = 2, 4, 6) and a shared system prompt, ``paged``: memory saved by
  sharing, computed as the vLLM paper does (blocks saved / blocks needed without sharing);
* block size 8 ... 128 against utilisation, ``paged``.

The budget is ``--kv-tokens`` token slots at the model's dtype (``--model-dtype``, fp16 for
OPT-13B); ``--kv-cache-dtype`` stores KV narrower, so the same bytes hold more slots (fp8: 2x
an fp16 model's, 4x a float32 model's), as the engine's block count does.

Writes ``memory.json``, ``memory.md`` and the PNGs into ``--out``.
"""

from __future__ import annotations

import math
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.memory_sim import EXECUTOR_NOTE, POLICIES, SimConfig, SimResult, simulate
from pagedserve.benchmarks.report import command_line, fmt_pct, md_table, write_json
from pagedserve.benchmarks.workloads import WORKLOADS, next_pow2
from pagedserve.config import KV_CACHE_DTYPES, kv_element_bytes

__all__ = ["MemoryOptions", "run_memory"]

# OPT-13B, the paper's running example: 2 (K, V) x 40 layers x 5120 hidden elements per token
# (x 2 bytes in fp16).
OPT13B_KV_ELEMENTS_PER_TOKEN = 2 * 40 * 5120
OPT13B_KV_BYTES_PER_TOKEN = OPT13B_KV_ELEMENTS_PER_TOKEN * 2

PAPER = {
    "token_states": {"paged": 0.963, "reserve": 0.204, "reserve-pow2": 0.268,
                     "reserve-oracle": 0.382},
    "parallel_sampling_alpaca": (0.061, 0.098),
    "parallel_sampling_sharegpt": (0.162, 0.305),
}


@dataclass
class MemoryOptions:
    out: Path
    quick: bool = False
    seed: int = 0
    block_size: int = 16
    kv_tokens: int = 32768
    max_model_len: int = 2048
    sharegpt_requests: int = 1000
    sharegpt_rate: float = 30.0
    alpaca_requests: int = 3000
    alpaca_rate: float = 800.0
    kv_bytes_per_token: int | None = None
    """At the model dtype (None: OPT-13B's at ``model_dtype``); the KV dtype scales it."""
    model_dtype: str = "float16"
    kv_cache_dtype: str = "auto"
    progress: bool = True
    argv: list[str] | None = None

    def kv_ratio(self, kv_cache_dtype: str | None = None) -> tuple[int, int]:
        """(model, KV) bytes per element: the KV dtype holds model / KV times the slots."""
        kv = kv_cache_dtype or self.kv_cache_dtype
        return (kv_element_bytes("auto", self.model_dtype),
                kv_element_bytes(kv, self.model_dtype))

    def kv_slots(self, kv_cache_dtype: str | None = None) -> int:
        """Token slots the budget (``kv_tokens`` slots at the model dtype) holds in KV bytes."""
        model, kv = self.kv_ratio(kv_cache_dtype)
        return self.kv_tokens * model // kv

    def model_token_bytes(self) -> int:
        if self.kv_bytes_per_token is not None:
            return self.kv_bytes_per_token
        return OPT13B_KV_ELEMENTS_PER_TOKEN * self.kv_ratio("auto")[0]

    def kv_token_bytes(self, kv_cache_dtype: str | None = None) -> int:
        model, kv = self.kv_ratio(kv_cache_dtype)
        return self.model_token_bytes() * kv // model

    def scaled(self) -> MemoryOptions:
        if not self.quick:
            return self
        return replace(
            self, kv_tokens=min(self.kv_tokens, 16384), sharegpt_requests=160,
            alpaca_requests=600,
        )


def _plan(o: MemoryOptions) -> list[tuple[str, SimConfig]]:
    base = SimConfig(block_size=o.block_size, kv_tokens=o.kv_slots(),
                     max_model_len=o.max_model_len, seed=o.seed)
    wl = {
        "sharegpt": {"num_requests": o.sharegpt_requests, "rate": o.sharegpt_rate},
        "alpaca": {"num_requests": o.alpaca_requests, "rate": o.alpaca_rate},
    }
    heat_until = o.sharegpt_requests / o.sharegpt_rate
    runs: list[tuple[str, SimConfig]] = []
    for name in ("sharegpt", "alpaca"):
        for pol in POLICIES:
            heat = 320 if name == "sharegpt" and pol in ("paged", "reserve") else 0
            runs.append((f"policy/{name}/{pol}", replace(
                base, workload=name, policy=pol, heatmap_rows=heat,
                heatmap_until_s=heat_until, **wl[name])))
    ns = (2, 4) if o.quick else (2, 4, 6)
    for name in ("alpaca", "sharegpt"):
        for n in ns:
            # n sequences per request: a rate n times lower (and 3x below the policy runs')
            # keeps about the same number of sequences in flight, the cache not saturated.
            runs.append((f"parallel/{name}/n{n}", replace(
                base, workload=name, n=n, num_requests=wl[name]["num_requests"],
                rate=wl[name]["rate"] / n / 3)))
    for plen in (80, 341):
        runs.append((f"prefix/alpaca/{plen}", replace(
            base, workload="alpaca", system_prompt_len=plen, enable_caching=True,
            num_requests=wl["alpaca"]["num_requests"], rate=wl["alpaca"]["rate"] / 3)))
    sizes = (8, 16, 64) if o.quick else (8, 16, 32, 64, 128)
    for name in ("sharegpt", "alpaca"):
        for bs in sizes:
            runs.append((f"block_size/{name}/{bs}", replace(
                base, workload=name, block_size=bs, **wl[name])))
    return runs


def _kv_bytes_table(o: MemoryOptions, results: dict[str, SimResult]) -> list[dict[str, Any]]:
    """KV bytes one request holds at its end, at the workload's mean and P95 length."""
    rows = []
    bpt = o.kv_token_bytes()
    for name in ("sharegpt", "alpaca"):
        length = results[f"policy/{name}/paged"].summary["request_length"]
        for pol in POLICIES:
            r = results[f"policy/{name}/{pol}"].summary
            row: dict[str, Any] = {"workload": name, "policy": pol}
            for key in ("mean", "p95"):
                n = int(math.ceil(length[key]))
                slots = {
                    "paged": -(-n // o.block_size) * o.block_size,
                    "reserve": o.max_model_len,
                    "reserve-pow2": min(next_pow2(n), o.max_model_len),
                    "reserve-oracle": n,
                }[pol]
                slots = -(-slots // o.block_size) * o.block_size  # whole blocks
                row[f"length_{key}"] = n
                row[f"bytes_at_{key}"] = slots * bpt
            row["measured_mean_bytes_per_sequence"] = r["mean_allocated_slots_per_sequence"] * bpt
            rows.append(row)
    return rows


def _kv_dtype_table(o: MemoryOptions) -> list[dict[str, Any]]:
    """Per KV cache dtype: element bytes, bytes per token and slots in this budget."""
    budget = o.kv_tokens * o.model_token_bytes()
    return [{"kv_cache_dtype": kv, "element_bytes": o.kv_ratio(kv)[1],
             "bytes_per_token": o.kv_token_bytes(kv), "token_slots": o.kv_slots(kv),
             "budget_bytes": budget, "ratio": o.kv_slots(kv) / o.kv_tokens}
            for kv in KV_CACHE_DTYPES]


def _targets(results: dict[str, SimResult]) -> dict[str, Any]:
    s = {k: v.summary for k, v in results.items()}
    paged = s["policy/sharegpt/paged"]
    reserve = s["policy/sharegpt/reserve"]
    ratio = paged["max_concurrent_sequences"] / max(1, reserve["max_concurrent_sequences"])
    ps = {k.split("/")[-1]: v["sharing_saving"] for k, v in s.items()
          if k.startswith("parallel/alpaca/")}
    lo, hi = PAPER["parallel_sampling_alpaca"]
    return {
        "paged_utilisation_at_least_96pct": {
            "value": paged["utilisation_steady"], "met": paged["utilisation_steady"] >= 0.96},
        "reserve_utilisation_near_20_40pct": {
            "value": reserve["utilisation_steady"],
            "met": 0.15 <= reserve["utilisation_steady"] <= 0.45},
        "concurrency_paged_over_reserve_at_least_2.5x": {"value": ratio, "met": ratio >= 2.5},
        "parallel_sampling_alpaca_within_6.1_9.8pct": {
            "value": ps, "met": all(lo <= v <= hi for v in ps.values()),
            "within_one_point": all(lo - 0.01 <= v <= hi + 0.01 for v in ps.values())},
    }


def run_memory(o: MemoryOptions) -> dict[str, Any]:
    """Run every experiment, write the JSON, markdown and plots; return the JSON document."""
    o = o.scaled()
    o.kv_slots()  # refuses an unknown dtype by name before any run
    o.out.mkdir(parents=True, exist_ok=True)
    plan = _plan(o)
    total = sum(c.num_requests * c.n for _, c in plan)
    print(f"pagedserve bench memory: {len(plan)} runs, {EXECUTOR_NOTE}")
    bar = _progress(total, o.progress)
    results: dict[str, SimResult] = {}
    wall: dict[str, float] = {}
    t_all = time.perf_counter()
    try:
        for key, cfg in plan:
            bar.set_description(key)
            t0 = time.perf_counter()
            results[key] = simulate(cfg, progress=bar.update)
            wall[key] = time.perf_counter() - t0
    finally:
        bar.close()
    elapsed = time.perf_counter() - t_all
    doc: dict[str, Any] = {
        "command": command_line(o.argv),
        "executor": EXECUTOR_NOTE,
        "quick": o.quick,
        "machine": f"{platform.machine()}, python {platform.python_version()}",
        "wall_seconds": elapsed,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(o).items()
                    if k not in ("argv", "progress")},
        "workloads": {n: WORKLOADS[n].description for n in ("sharegpt", "alpaca")},
        "paper": PAPER,
        "runs": {k: {"config": asdict(r.config), **r.summary, "wall_seconds": wall[k]}
                 for k, r in results.items()},
        "kv_bytes_per_request": _kv_bytes_table(o, results),
        "kv_cache_dtypes": _kv_dtype_table(o),
        "targets": _targets(results),
    }
    write_json(o.out / "memory.json", doc)
    from pagedserve.benchmarks import plots

    plots.memory_heatmap(results["policy/sharegpt/paged"], results["policy/sharegpt/reserve"],
                         o.out / "memory_heatmap.png")
    plots.memory_utilisation(
        {p: results[f"policy/sharegpt/{p}"] for p in POLICIES}, o.out / "memory_utilisation.png")
    plots.memory_waste({p: results[f"policy/sharegpt/{p}"].summary for p in POLICIES},
                       PAPER["token_states"], o.out / "memory_waste.png")
    plots.memory_block_size(doc["runs"], o.out / "memory_block_size.png")
    (o.out / "memory.md").write_text(_markdown(doc))
    print(f"wrote {o.out}/memory.json, memory.md and 4 PNGs in {elapsed:.0f} s")
    for name, t in doc["targets"].items():
        print(f"  target {name}: {_short(t['value'])} -> {'met' if t['met'] else 'NOT met'}")
    return doc


def _short(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k} {x:.1%}" for k, x in v.items())
    return f"{v:.3g}"


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="seq", disable=not enabled, smoothing=0.1,
                dynamic_ncols=True, mininterval=0.5)


# ----------------------------------------------------------------------------- markdown
def _markdown(doc: dict[str, Any]) -> str:
    runs = doc["runs"]
    o = doc["options"]
    out = [
        "# KV memory under four allocation policies",
        "",
        "Produced by (the JSON beside this file holds every number):",
        "",
        "```",
        doc["command"],
        "```",
        "",
        f"**Executor**: {doc['executor']}. The step-cost model is "
        f"{runs['policy/sharegpt/paged']['config']['step_base_s'] * 1e3:.0f} ms + "
        f"{runs['policy/sharegpt/paged']['config']['step_per_token_s'] * 1e6:.0f} us per "
        "batched token; it only orders arrivals against steps.",
        "",
        f"KV budget: {_slots(doc)['token_slots']:,} token slots "
        f"({_slots(doc)['token_slots'] // o['block_size']:,} blocks of {o['block_size']}; "
        f"KV cache dtype `{o['kv_cache_dtype']}` under a {o['model_dtype']} model, "
        f"{_slots(doc)['ratio']:g}x the {o['kv_tokens']:,} slots of the model's dtype in "
        f"the same bytes), max_model_len {o['max_model_len']}, "
        f"{doc['machine']}, {doc['wall_seconds']:.0f} s wall for all runs"
        + (" (`--quick`)." if doc["quick"] else "."),
        "",
        "Workloads: " + "; ".join(f"`{k}`: {v}" for k, v in doc["workloads"].items()) + ". "
        f"ShareGPT-like: {o['sharegpt_requests']} requests at {o['sharegpt_rate']:g}/s; "
        f"Alpaca-like: {o['alpaca_requests']} at {o['alpaca_rate']:g}/s (Poisson). Statistics "
        "are time-weighted over the steady window (from the arrival of the 10th-percentile "
        "request to the last arrival).",
        "",
        "## Policies",
        "",
    ]
    for name in ("sharegpt", "alpaca"):
        rows = []
        for pol in POLICIES:
            r = runs[f"policy/{name}/{pol}"]
            f = r["fragmentation_steady"]
            sh = r["pool_shares_steady"]
            rows.append([
                f"`{pol}` ({r['label']})", fmt_pct(r["utilisation_steady"]),
                f"{fmt_pct(f['p5'])} / {fmt_pct(f['p50'])} / {fmt_pct(f['p95'])}",
                str(r["max_concurrent_sequences"]), f"{r['mean_concurrent_sequences']:.1f}",
                str(r["preemptions"]), fmt_pct(sh["token_states"]), fmt_pct(sh["reservation"]),
                fmt_pct(sh["internal_fragmentation"]), fmt_pct(sh["external_fragmentation"]),
                fmt_pct(sh["free"]),
            ])
        out += [
            f"### {name}",
            "",
            md_table(
                ["policy", "slots holding tokens / allocated", "fragmentation P5 / P50 / P95",
                 "max concurrent", "mean concurrent", "preemptions", "pool: tokens",
                 "reservation", "internal frag.", "external frag.", "free"],
                rows,
            ),
            "",
        ]
    out += [
        "Fragmentation is 1 - used slots / (allocated blocks x B) per steady-state step. The "
        "pool columns split the whole KV pool as the paper's Fig. 2 does: slots holding "
        "tokens; reserved for tokens the request will still write; internal fragmentation "
        "(allocated, never written: beyond the request's final length); external "
        "fragmentation (free, but in contiguous runs too short for the next waiting "
        "request's reservation; only the reservation policies need contiguous runs); free.",
        "",
        "Paper (Fig. 2, ShareGPT, OPT-13B): token states 96.3% (vLLM), 20.4% (Orca-Max), "
        "26.8% (Orca-Pow2), 38.2% (Orca-Oracle).",
        "",
        "## KV bytes per request",
        "",
        f"At {_slots(doc)['bytes_per_token']:,} bytes per token (OPT-13B: 2 x 40 layers x "
        f"5120 x {_slots(doc)['element_bytes']} bytes), for a request of the workload's mean "
        "and P95 length (prompt + output), and the measured time-average per running sequence:",
        "",
        md_table(
            ["workload", "policy", "mean length", "bytes at mean", "P95 length",
             "bytes at P95", "measured mean per sequence"],
            [[r["workload"], f"`{r['policy']}`", str(r["length_mean"]),
              _mb(r["bytes_at_mean"]), str(r["length_p95"]), _mb(r["bytes_at_p95"]),
              _mb(r["measured_mean_bytes_per_sequence"])]
             for r in doc["kv_bytes_per_request"]],
        ),
        "",
        "## KV cache dtype",
        "",
        f"The same {_mb(doc['kv_cache_dtypes'][0]['budget_bytes'])} of KV under a "
        f"{o['model_dtype']} model (`--kv-cache-dtype`; the runs above use "
        f"`{o['kv_cache_dtype']}`):",
        "",
        md_table(["KV cache dtype", "bytes per element", "bytes per token", "token slots",
                  "vs the model's dtype"],
                 [[f"`{r['kv_cache_dtype']}`", str(r["element_bytes"]),
                   f"{r['bytes_per_token']:,}", f"{r['token_slots']:,}", f"{r['ratio']:g}x"]
                  for r in doc["kv_cache_dtypes"]]),
        "",
        "## Sharing (paged)",
        "",
        "Memory saved = blocks saved by sharing / blocks needed without sharing, "
        "time-weighted over the steady window. Parallel sampling forks n sequences off one "
        "prompt (copy-on-write of the partial last block); the shared system prompt is found "
        "by prefix caching.",
        "",
    ]
    rows = []
    for k, r in runs.items():
        if k.startswith(("parallel/", "prefix/")):
            kind, name, what = k.split("/")
            label = f"parallel sampling n={what[1:]}" if kind == "parallel" else (
                f"shared system prompt of {what} tokens")
            paper = ""
            if kind == "parallel":
                lo, hi = doc["paper"][f"parallel_sampling_{name}"]
                paper = f"{lo:.1%}-{hi:.1%} (n = 2 ... 6)"
            rows.append([label, name, fmt_pct(r["sharing_saving"]), paper,
                         str(r["max_concurrent_sequences"])])
    out += [md_table(["experiment", "workload", "memory saved", "paper", "max concurrent seqs"],
                     rows), ""]
    out += ["## Block size (paged)", ""]
    rows = []
    for k, r in runs.items():
        if k.startswith("block_size/"):
            _, name, bs = k.split("/")
            rows.append([name, bs, fmt_pct(r["utilisation_steady"]),
                         str(r["max_concurrent_sequences"]), str(r["preemptions"])])
    out += [md_table(["workload", "block size", "slots holding tokens / allocated",
                      "max concurrent", "preemptions"], rows), ""]
    out += ["## Targets", ""]
    out += [md_table(["target", "measured", "met"],
                     [[k, _short(t["value"]), "yes" if t["met"] else "**no**"]
                      for k, t in doc["targets"].items()]), ""]
    out += ["Plots: `memory_heatmap.png`, `memory_utilisation.png`, `memory_waste.png`, "
            "`memory_block_size.png`.", ""]
    return "\n".join(out)


def _slots(doc: dict[str, Any]) -> dict[str, Any]:
    """The KV-dtype row of the runs' own dtype."""
    kv = doc["options"]["kv_cache_dtype"]
    return next(r for r in doc["kv_cache_dtypes"] if r["kv_cache_dtype"] == kv)


def _mb(x: float) -> str:
    return f"{x / 2**20:,.0f} MiB"

