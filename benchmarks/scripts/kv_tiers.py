"""The host KV tier, measured: swap against recompute (the vLLM paper's §7.3), and the prefix
cache with and without the tier on a workload whose shared prefixes exceed the device pool.

Part ``swap`` (the paper's Fig. 19):

* (a) *micro*: the time to swap ``--tokens`` tokens of KV out to the host tier and back in
  (``KVPool.copy_tiers``: one gather and one indexed scatter per layer, batched over the
  blocks), against the time to recompute them (one prefill forward pass of those tokens), for
  each block size. Medians of ``--repeats`` runs on a real worker with the demo model.
* (b) *end to end*: a workload that overflows a small device pool, so requests are preempted,
  run once per preemption mode and block size: wall time and preemptions.

Part ``prefix``: ``--families`` prompt families share a prefix of ``--prefix`` tokens; requests
visit the families round-robin, ``--concurrency`` at a time, so by the time a family comes
back its blocks were evicted from the device pool (which holds about a third of the prefixes).
With the tier on, evicted blocks wait in host memory and the next hit copies them back. Hit
rate (prompt tokens served from the cache / looked up), hits per tier, and time to first token
(from submission to the first token's delta) with the tier off and on.

Both parts run the demo checkpoint in this process (the local executor, one CPU worker); on a
GPU machine the host tier is pinned memory and the copies cross PCIe, so the absolute numbers
differ, not the method.

    python benchmarks/scripts/kv_tiers.py --out-dir docs/results/kv_tiers
    python benchmarks/scripts/kv_tiers.py --quick --out-dir /tmp/kv_tiers    # a few seconds
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from pagedserve.builder import make_executor, resolve_model_dir
from pagedserve.config import from_flat
from pagedserve.controller.engine_core import EngineCore
from pagedserve.messages import (
    AddRequest,
    KVCacheLayout,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from pagedserve.workers.worker import Worker

FIRST_TOKEN = 3  # the demo vocabulary's ids 0-2 are special tokens


def _tokens(seed: int, n: int) -> list[int]:
    return [FIRST_TOKEN + (seed * 7919 + i * 104729) % 500 for i in range(n)]


# ------------------------------------------------------------------------------ swap, micro
def swap_micro(model: str, block_sizes: list[int], tokens: int, repeats: int) -> list[dict]:
    rows = []
    for bs in block_sizes:
        n = -(-tokens // bs)
        cfg = from_flat(model=model, dtype="float32", block_size=bs, max_model_len=tokens + bs,
                        max_num_batched_tokens=tokens + bs)
        worker = Worker(cfg)
        worker.load_model()
        worker.init_kv_cache(KVCacheLayout(n + 1, bs, [list(range(cfg_layers(worker)))], n + 1))
        pool = worker.runner.kv_pool  # type: ignore[union-attr]
        pairs = [(1 + i, 1 + i) for i in range(n)]
        swap_s, recompute_s = [], []
        for r in range(repeats + 1):  # the first run warms up
            t0 = time.perf_counter()
            pool.copy_tiers(pairs, [])
            pool.copy_tiers([], pairs)
            t1 = time.perf_counter()
            so = SchedulerOutput(step_id=2 * r, total_num_scheduled_tokens=tokens)
            so.new_reqs.append(NewRequestData(
                f"r{r}", _tokens(r, tokens), [], SamplingParams(max_tokens=1),
                [list(range(1, n + 1))], 0))
            so.num_scheduled_tokens = {f"r{r}": tokens}
            worker.execute(so)
            t2 = time.perf_counter()
            worker.execute(SchedulerOutput(step_id=2 * r + 1, finished_req_ids=[f"r{r}"]))
            if r:
                swap_s.append(t1 - t0)
                recompute_s.append(t2 - t1)
        worker.shutdown()
        swap, rec = statistics.median(swap_s), statistics.median(recompute_s)
        rows.append({"block_size": bs, "blocks": n, "swap_ms": 1e3 * swap,
                     "recompute_ms": 1e3 * rec, "ratio": swap / rec})
    return rows


def cfg_layers(worker: Worker) -> int:
    return len(worker.model.attention_layers())  # type: ignore[union-attr,operator]


# -------------------------------------------------------------------------- swap, end to end
def _engine(model: str, **options) -> EngineCore:
    cfg = from_flat(model=model, dtype="float32", **options)
    return EngineCore(cfg, make_executor(cfg), eos_token_ids=())


def _drain(engine: EngineCore, submit_times: dict[str, float]) -> dict[str, float]:
    """Step until idle; the time of each request's first token delta."""
    first: dict[str, float] = {}
    while engine.has_unfinished():
        for d in engine.step():
            if d.request_id not in first and any(c.token_ids for c in d.completions):
                first[d.request_id] = time.perf_counter()
    return first


def swap_e2e(model: str, block_sizes: list[int], num_requests: int, prompt: int,
             output: int, capacity: int) -> list[dict]:
    rows = []
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    for bs in block_sizes:
        for mode in ("recompute", "swap"):
            blocks = -(-capacity // bs) + 1
            extra = {"num_host_blocks": 4 * blocks} if mode == "swap" else {}
            eng = _engine(model, block_size=bs, num_gpu_blocks=blocks, preemption_mode=mode,
                          max_num_batched_tokens=512, **extra)
            t0 = time.perf_counter()
            for i in range(num_requests):
                eng.add_request(AddRequest(f"r{i}", _tokens(i, prompt), params))
            _drain(eng, {})
            wall = time.perf_counter() - t0
            s = eng.stats()
            eng.kv.check_integrity()
            leaked = (eng.kv.num_free_blocks != eng.kv.pool.num_usable_blocks) or (
                eng.kv.host is not None
                and eng.kv.host.num_free_blocks != eng.kv.host.num_usable_blocks)
            rows.append({"block_size": bs, "mode": mode, "preemptions": s["num_preemptions"],
                         "swap_fallbacks": s.get("kv_host_swap_fallbacks", 0),
                         "wall_s": wall, "tok_s": num_requests * output / wall,
                         "leaked": bool(leaked)})
            eng.shutdown()
    return rows


# ------------------------------------------------------------------------------ prefix tier
def prefix_tier(model: str, families: int, prefix: int, rounds: int, concurrency: int,
                device_blocks: int, host_blocks: int, block_size: int) -> list[dict]:
    heads = [_tokens(1000 + f, prefix) for f in range(families)]
    order = [(r, f) for r in range(rounds) for f in range(families)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    rows = []
    for tier in ("off", "on"):
        extra = {"num_host_blocks": host_blocks} if tier == "on" else {}
        eng = _engine(model, block_size=block_size, num_gpu_blocks=device_blocks,
                      max_num_batched_tokens=max(512, prefix + 64), **extra)
        submitted: dict[str, float] = {}
        first: dict[str, float] = {}
        cached: dict[str, int] = {}
        prompt_tokens = 0
        pending = list(order)
        t0 = time.perf_counter()
        while pending or eng.has_unfinished():
            while pending and len(submitted) - len(first) < concurrency:
                r, f = pending.pop(0)
                rid = f"f{f}-r{r}"
                ids = heads[f] + _tokens(r * 97 + f, 16)
                prompt_tokens += len(ids)
                eng.add_request(AddRequest(rid, ids, params))
                submitted[rid] = time.perf_counter()
            for d in eng.step():
                cached[d.request_id] = d.num_cached_tokens
                if d.request_id not in first and any(c.token_ids for c in d.completions):
                    first[d.request_id] = time.perf_counter()
        wall = time.perf_counter() - t0
        s = eng.stats()
        ttft = [first[k] - submitted[k] for k in submitted]
        eng.kv.check_integrity()
        rows.append({
            # Per request: prompt tokens served from the cache at admission / prompt tokens.
            "tier": tier, "hit_rate": sum(cached.values()) / prompt_tokens,
            "lookup_hit_rate": s["prefix_cache_hits"] / max(1, s["prefix_cache_queries"]),
            "device_hits": s["prefix_cache_device_hits"], "host_hits": s["prefix_cache_host_hits"],
            "queries": s["prefix_cache_queries"], "ttft_mean_ms": 1e3 * statistics.mean(ttft),
            "ttft_p50_ms": 1e3 * statistics.median(ttft), "wall_s": wall,
            "offloaded": s.get("kv_host_offloaded_blocks", 0),
        })
        eng.shutdown()
    return rows


# ------------------------------------------------------------------------------ reporting
def report(micro: list[dict], e2e: list[dict], prefix: list[dict], args: argparse.Namespace,
           command: str) -> str:
    lines = [f"Command: `{command}`", "",
             f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
             f"torch {torch.__version__}, device cpu (host tier: a second pool in memory).", ""]
    if micro:
        lines += [f"### Swap vs recompute, {args.tokens} tokens (the paper's Fig. 19a)", "",
                  "| block size | blocks | swap out + in (ms) | recompute (ms) | "
                  "swap / recompute |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['block_size']} | {r['blocks']} | {r['swap_ms']:.2f} | "
                  f"{r['recompute_ms']:.2f} | {r['ratio']:.3f} |" for r in micro]
        lines.append("")
    if e2e:
        lines += [f"### End to end under preemption ({args.requests} requests of "
                  f"{args.prompt} + {args.output} tokens, a pool of {args.capacity} tokens; "
                  "the paper's Fig. 19b)", "",
                  "| block size | mode | preemptions | swap fallbacks | wall (s) | tokens/s | "
                  "leaked blocks |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['block_size']} | {r['mode']} | {r['preemptions']} | "
                  f"{r['swap_fallbacks']} | {r['wall_s']:.2f} | {r['tok_s']:.1f} | "
                  f"{'yes' if r['leaked'] else 0} |" for r in e2e]
        lines.append("")
    if prefix:
        lines += [f"### Prefix cache with and without the host tier ({args.families} families x "
                  f"{args.prefix}-token prefixes, {args.rounds} rounds round-robin, "
                  f"{args.concurrency} in flight; device pool {args.device_blocks} blocks of "
                  f"{args.prefix_block_size}, host tier {args.host_blocks})", "",
                  "| host tier | hit rate | hit rate per lookup | device hits | host hits | "
                  "mean TTFT (ms) | p50 TTFT (ms) | wall (s) | blocks offloaded |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['tier']} | {r['hit_rate']:.3f} | {r['lookup_hit_rate']:.3f} | "
                  f"{r['device_hits']} | "
                  f"{r['host_hits']} | {r['ttft_mean_ms']:.1f} | {r['ttft_p50_ms']:.1f} | "
                  f"{r['wall_s']:.2f} | {r['offloaded']} |" for r in prefix]
        off, on = prefix
        ratio = (f"{on['hit_rate'] / off['hit_rate']:.2f}x" if off["hit_rate"]
                 else f"{on['hit_rate']:.3f} against none")
        lines += ["", "Hit rate: prompt tokens each request found cached at admission over its "
                  "prompt tokens. Per lookup, and the per-tier hits: the engine's counters, "
                  "which count a waiting request again at each admission attempt.",
                  "", f"Hit rate with the tier / without: {ratio}; mean TTFT "
                  f"{on['ttft_mean_ms']:.1f} ms against {off['ttft_mean_ms']:.1f} ms.", ""]
    return "\n".join(lines)


def plot(micro: list[dict], prefix: list[dict], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if micro:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        bs = [r["block_size"] for r in micro]
        ax.plot(bs, [r["swap_ms"] for r in micro], "o-", label="swap out + in")
        ax.plot(bs, [r["recompute_ms"] for r in micro], "s-", label="recompute")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("ms")
        ax.set_title("Swap vs recompute (Fig. 19a)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "swap_vs_recompute.png", dpi=120)
        plt.close(fig)
    if prefix:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(7, 3))
        names = [f"tier {r['tier']}" for r in prefix]
        a1.bar(names, [r["hit_rate"] for r in prefix], color=["#999", "#37a"])
        a1.set_ylabel("prefix hit rate")
        a2.bar(names, [r["ttft_mean_ms"] for r in prefix], color=["#999", "#37a"])
        a2.set_ylabel("mean TTFT (ms)")
        fig.suptitle("Prefix cache with and without the host tier")
        fig.tight_layout()
        fig.savefig(out_dir / "prefix_tier.png", dpi=120)
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["swap", "prefix", "all"], default="all")
    p.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt", type=int, default=96)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--capacity", type=int, default=480, help="device pool size in tokens")
    p.add_argument("--families", type=int, default=8)
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--device-blocks", type=int, default=49)
    p.add_argument("--host-blocks", type=int, default=257)
    p.add_argument("--prefix-block-size", type=int, default=16)
    args = p.parse_args(argv)
    if args.quick:
        args.block_sizes, args.tokens, args.repeats = [8, 32], 128, 2
        args.requests, args.prompt, args.output, args.capacity = 4, 24, 16, 96
        args.families, args.prefix, args.rounds = 4, 48, 2
        args.device_blocks, args.host_blocks = 12, 40
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    model = resolve_model_dir("demo")
    command = "python benchmarks/scripts/kv_tiers.py " + " ".join(argv if argv is not None
                                                          else sys.argv[1:])
    micro = e2e = prefix = []
    if args.part in ("swap", "all"):
        micro = swap_micro(model, args.block_sizes, args.tokens, args.repeats)
        e2e = swap_e2e(model, [b for b in args.block_sizes if 8 <= b <= 32] or args.block_sizes,
                       args.requests, args.prompt, args.output, args.capacity)
    if args.part in ("prefix", "all"):
        prefix = prefix_tier(model, args.families, args.prefix, args.rounds, args.concurrency,
                             args.device_blocks, args.host_blocks, args.prefix_block_size)
    text = report(micro, e2e, prefix, args, command.strip())
    print(text)
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "kv_tiers.md").write_text(text + "\n")
        (args.out_dir / "kv_tiers.json").write_text(
            json.dumps({"micro": micro, "e2e": e2e, "prefix": prefix}, indent=1) + "\n")
        plot(micro, prefix, args.out_dir)
    leaked = any(r["leaked"] for r in e2e)
    return 1 if leaked else 0


if __name__ == "__main__":
    sys.exit(main())
