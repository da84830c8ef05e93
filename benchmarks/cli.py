"""``pagedserve bench memory|serving``: argument parsing (the work is imported on use)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.report import RUNS_DIR, results_dir
from pagedserve.config import KV_CACHE_DTYPES

__all__ = ["add_bench_parser", "run_bench"]

_OUT_HELP = (f"the folder for the results (default: a fresh {RUNS_DIR}/EXPERIMENT-TIMESTAMP "
             "under the current directory; the committed ones take --out docs/results/...)")


def _floats(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers: {text!r}") from exc
    if not vals or any(not v > 0 or math.isnan(v) for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive numbers: {text!r}")
    return vals


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "bench", help="run the experiments: memory (KV allocation policies), serving (HTTP)")
    sub = p.add_subparsers(dest="bench_command", metavar="EXPERIMENT")

    m = sub.add_parser(
        "memory",
        help="allocation policies under one KV budget, sharing, block sizes (no compute)",
        description="Drive the real scheduler and KV manager with synthetic workloads and a "
        "no-compute executor; compare paged against reserve (Orca-Max), Orca-Pow2 and "
        "Orca-Oracle. Writes memory.json, memory.md and PNGs into --out.")
    m.add_argument("--out", type=Path, default=None, help=_OUT_HELP)
    m.add_argument("--quick", action="store_true", help="a small run (CI): about 30 s")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--block-size", type=int, default=16)
    m.add_argument("--kv-tokens", type=int, default=32768,
                   help="the fixed KV budget, in token slots (default 32768)")
    m.add_argument("--max-model-len", type=int, default=2048)
    m.add_argument("--sharegpt-requests", type=int, default=1000)
    m.add_argument("--sharegpt-rate", type=float, default=30.0)
    m.add_argument("--alpaca-requests", type=int, default=3000)
    m.add_argument("--alpaca-rate", type=float, default=800.0)
    m.add_argument("--kv-bytes-per-token", type=int, default=None,
                   help="at the model dtype, for the bytes-per-request table (default: "
                        "OPT-13B fp16, 800 KiB)")
    m.add_argument("--model-dtype", default="float16", choices=("float32", "float16", "bfloat16"),
                   help="the dtype --kv-tokens and --kv-bytes-per-token are counted in "
                        "(default float16, OPT-13B's)")
    m.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV cache's dtype: the same bytes hold model / KV element bytes "
                        "times the slots (fp8_e4m3 under float32: 4x)")
    m.add_argument("--no-progress", action="store_true")

    s = sub.add_parser(
        "serving",
        help="request-rate sweep over HTTP against pagedserve serve (paged vs reserve)",
        description="Measure latency and throughput at a sweep of Poisson request rates, "
        "streaming from /v1/completions and timing each server-sent event. Without --url, "
        "starts one `pagedserve serve` per allocation policy. Writes serving.json, "
        "serving.md and PNGs into --out.")
    s.add_argument("--out", type=Path, default=None, help=_OUT_HELP + "; --replot reads it")
    s.add_argument("--quick", action="store_true",
                   help="a small run (CI): tiny lengths, 2 rates, local-backend servers")
    s.add_argument("--url", default=None,
                   help="measure this running server instead of starting servers")
    s.add_argument("--label", default="server", help="the --url server's name in the results")
    s.add_argument("--policies", default="paged,reserve",
                   help="allocation policies to start servers for (default paged,reserve)")
    s.add_argument("--rates", type=_floats, default=None,
                   help="request rates, req/s, comma separated (default 0.5,0.75,1,1.5,2,2.5,3,4)")
    s.add_argument("--duration", type=float, default=None,
                   help="seconds of arrivals per rate: rate x DURATION requests (default 40)")
    s.add_argument("--num-requests", type=int, default=None,
                   help="a fixed number of requests per rate instead of --duration")
    s.add_argument("--workload", default=None,
                   choices=["sharegpt", "sharegpt-vllm", "alpaca", "tiny"])
    s.add_argument("--burstiness", type=float, default=1.0)
    s.add_argument("--slo", type=float, default=None,
                   help="normalised-latency SLO in s/token (default 0.1)")
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV pool of the started servers (default 257: reserve fits 2 requests)")
    s.add_argument("--backend", choices=["ray", "local"], default=None)
    s.add_argument("--server-args", default="",
                   help="more options for the started servers, e.g. \"--model DIR\"")
    s.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding for the started servers, e.g. "
                        "'{\"method\": \"ngram\"}'")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--replot", action="store_true",
                   help="only redraw serving.md and the PNGs from OUT/serving.json")
    return p


def run_bench(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    if args.bench_command == "memory":
        from pagedserve.benchmarks.memory import MemoryOptions, run_memory

        mo = MemoryOptions(
            out=results_dir(args.out, "memory"), quick=args.quick, seed=args.seed,
            block_size=args.block_size, kv_tokens=args.kv_tokens, max_model_len=args.max_model_len,
            sharegpt_requests=args.sharegpt_requests, sharegpt_rate=args.sharegpt_rate,
            alpaca_requests=args.alpaca_requests, alpaca_rate=args.alpaca_rate,
            model_dtype=args.model_dtype, kv_cache_dtype=args.kv_cache_dtype,
            progress=not args.no_progress, argv=argv,
        )
        if args.kv_bytes_per_token is not None:
            mo.kv_bytes_per_token = args.kv_bytes_per_token
        run_memory(mo)
        return 0
    if args.bench_command == "serving":
        from pagedserve.benchmarks.serving import ServingOptions, replot, run_serving

        if args.replot:
            if args.out is None:
                print("pagedserve bench serving: --replot needs --out (the earlier run's folder)")
                return 2
            replot(args.out)
            return 0
        so = ServingOptions(out=results_dir(args.out, "serving"), url=args.url, label=args.label,
                            policies=tuple(x for x in args.policies.split(",") if x),
                            burstiness=args.burstiness, server_args=args.server_args,
                            speculative_config=args.speculative_config,
                            seed=args.seed, quick=args.quick, progress=not args.no_progress,
                            argv=argv)
        so = so.scaled()  # the --quick presets; explicit options below win over them
        for key in ("rates", "num_requests", "workload", "slo", "max_model_len",
                    "num_gpu_blocks", "backend"):
            value = getattr(args, key)
            if value is not None:
                setattr(so, key, value)
        if args.num_requests is not None:
            so.duration_s = None
        if args.duration is not None:
            so.duration_s = args.duration
        run_serving(so)
        return 0
    print("pagedserve bench: choose an experiment: memory or serving")
    return 2

