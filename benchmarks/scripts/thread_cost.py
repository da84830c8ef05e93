"""What an op costs on the process's main thread and on another thread of the same process.

The in-process engine runs its forward pass on its loop thread; the Ray path runs it on the
worker actor's main thread. This times a parallel ATen op (an add of two 200k-element float32
tensors, split over the torch threads by OpenMP) and the batch-1 linears of a decode step on
SmolLM2's shapes (oneDNN on packed weights, at ``--dtype``): on the main thread, then on one
long-lived ``threading.Thread``, then on the main thread again. Each figure is the best of
``--rounds`` rounds of ``--calls`` calls.

    python benchmarks/scripts/thread_cost.py
    python benchmarks/scripts/thread_cost.py --dtype float32
"""

from __future__ import annotations

import argparse
import queue
import threading
import time
from collections.abc import Callable

import torch


def best_us(call: Callable[[], object], rounds: int, calls: int) -> float:
    for _ in range(50):
        call()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    big = torch.randn(200_000)
    x = torch.randn(1, 576, dtype=dtype)
    ops: dict[str, Callable[[], object]] = {"add, 200k float32 elements": lambda: big + big}
    for name, out in (("qkv", 960), ("o", 576), ("gate and up", 3072)):
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(out, 576, dtype=dtype), None)
        ops[f"linear {name}, 1x576 by 576x{out}, oneDNN packed"] = (
            lambda p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    results: queue.SimpleQueue = queue.SimpleQueue()

    def serve() -> None:  # the other thread: runs what it is handed, until None
        while (job := jobs.get()) is not None:
            results.put(best_us(job, args.rounds, args.calls))

    other = threading.Thread(target=serve, name="other")
    other.start()
    print(f"torch threads {torch.get_num_threads()}, best of {args.rounds} rounds of "
          f"{args.calls} calls\n")
    # Each op on the main thread first, then on the other thread, then on the main thread
    # again: the third column is the main thread once a second thread has run OpenMP regions.
    print("| op | main thread (us) | another thread (us) | main thread after it (us) |")
    print("|---|---|---|---|")
    times = {name: [best_us(op, args.rounds, args.calls)] for name, op in ops.items()}
    for name, op in ops.items():
        jobs.put(op)
        times[name].append(results.get())
    for name, op in ops.items():
        times[name].append(best_us(op, args.rounds, args.calls))
        print(f"| {name} | " + " | ".join(f"{t:.1f}" for t in times[name]) + " |")
    jobs.put(None)
    other.join()


if __name__ == "__main__":
    main()
