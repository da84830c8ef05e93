"""Offline throughput of the Ray worker group: output tokens/s of ``EngineCore`` driving a
``RayExecutor`` at tensor_parallel_size 1 and 2 (and, for reference, the in-process
``LocalExecutor``), same workload, greedy, ``ignore_eos``.

Each setup builds its engine (placement group, worker actors, model load; the build time is
reported separately), runs one warm-up request, then the whole batch through ``step()`` until
every request has finished.

Torch runs one thread per rank (``OMP_NUM_THREADS=1`` unless set): Ray gives each 1-CPU worker
actor one thread, and the in-process setup gets the same so the rows compare like for like (on a
shared 2-core machine, two spinning OpenMP threads per process cost several times over).

    python benchmarks/scripts/distributed_throughput.py --quick          # this 2-core CPU machine
    python benchmarks/scripts/distributed_throughput.py --setups ray:1,ray:2,ray:4 --model DIR
"""

from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported (by the local worker)

import numpy as np
import ray

from pagedserve.builder import make_executor, resolve_model_dir
from pagedserve.cluster.launch import ensure_ray
from pagedserve.cluster.placement import remove_quietly, reserve_worker_group
from pagedserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.outputs import OutputCollector
from pagedserve.messages import AddRequest, SamplingParams


def workload(seed: int, n: int, lo: int, hi: int, vocab: int):
    rng = np.random.default_rng(seed)
    ins = rng.integers(lo, hi + 1, size=n)
    outs = rng.integers(lo, hi + 1, size=n)
    prompts = [rng.integers(3, vocab, size=int(k)).tolist() for k in ins]
    return prompts, [int(o) for o in outs]


def run_until_done(engine: EngineCore, prompts, outs, prefix: str) -> int:
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        params = SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)
        engine.add_request(AddRequest(f"{prefix}{i}", p, params))
    produced = 0
    collector = OutputCollector()
    while engine.has_unfinished():
        for out in collector.feed(engine.step()):
            if out.finished:
                if out.error is not None:
                    raise RuntimeError(out.error)
                produced += len(out.outputs[0].token_ids)
    return produced


def bench(setup: str, model: str, args, prompts, outs) -> dict[str, float]:
    backend, tp = setup.split(":")
    config = EngineConfig(
        model=ModelConfig(model=model, dtype="float32"),
        cache=CacheConfig(block_size=16, kv_cache_memory_bytes=args.kv_cache_memory_bytes),
        parallel=ParallelConfig(tensor_parallel_size=int(tp)),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs
        ),
    )
    t0 = time.perf_counter()
    pg = reserve_worker_group(int(tp), "PACK", 60) if backend == "ray" else None
    engine = EngineCore(config, make_executor(config, backend, pg), eos_token_ids=())
    build_s = time.perf_counter() - t0
    try:
        run_until_done(engine, [[1, 2, 3]], [2], "warm")
        before = engine.stats()
        t0 = time.perf_counter()
        produced = run_until_done(engine, prompts, outs, "r")
        elapsed = time.perf_counter() - t0
        after = engine.stats()
    finally:
        engine.shutdown()
        remove_quietly(pg)
    assert produced == sum(outs), "every request must produce exactly max_tokens tokens"
    steps = after["num_steps"] - before["num_steps"]
    execute = after["time_execute_s"] - before["time_execute_s"]
    tokens = produced + sum(len(p) for p in prompts)
    return {
        "build_s": build_s,
        "elapsed_s": elapsed,
        "out_tok_s": produced / elapsed,
        "total_tok_s": tokens / elapsed,
        "steps": steps,
        "step_ms": 1e3 * elapsed / max(steps, 1),
        "execute_ms": 1e3 * execute / max(steps, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo", help="checkpoint dir or .gguf file (default: demo)")
    ap.add_argument("--setups", default="local:1,ray:1,ray:2", help="backend:tp, comma-separated")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="32 requests, lengths 16-128")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=64 << 20)
    ap.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the local Ray")
    ap.add_argument("--address", default=None, help="Ray address (default: start one here)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.min_len, args.max_len = 32, 16, 128

    model = resolve_model_dir(args.model)
    ensure_ray(args.address, num_cpus=args.num_cpus, log_to_driver=False)
    prompts, outs = workload(args.seed, args.num_requests, args.min_len, args.max_len, 512)
    print(
        f"model={model} requests={len(prompts)} input_tokens={sum(map(len, prompts))} "
        f"output_tokens={sum(outs)} machine={platform.machine()} cpus={os.cpu_count()} "
        f"ray={ray.__version__}"
    )
    print("| setup | build s | elapsed s | output tok/s | total tok/s | steps | ms/step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for setup in args.setups.split(","):
        r = bench(setup, model, args, prompts, outs)
        print(
            f"| {setup} | {r['build_s']:.1f} | {r['elapsed_s']:.2f} | {r['out_tok_s']:.1f} | "
            f"{r['total_tok_s']:.1f} | {r['steps']:.0f} | {r['step_ms']:.1f} |",
            flush=True,
        )
    ray.shutdown()


if __name__ == "__main__":
    main()
