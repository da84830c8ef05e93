"""Controller cost per step as outputs grow: everything ``EngineCore.step()`` does except the
executor's ``execute`` (scheduling, KV bookkeeping, token appends, detokenization, stop checks,
building the step's outputs).

64 requests with short distinct prompts run together with ``max_tokens=2048`` and
``ignore_eos``; a fake executor returns one token per scheduled request without computing, and
the time spent inside it is subtracted from each step. Times are this thread's CPU time by
default (``--clock wall`` for wall-clock), and each step's time is its minimum over
``--repeats`` identical seeded runs. All requests advance in lockstep, so a step's output length
is the same for every request; the table gives the median controller time of the steps whose
output length lies within ``--window`` tokens of each reported length, and its ratio to the
value at 16 tokens. A per-step cost that is O(new tokens) keeps the ratio near
1; one that rebuilds every request's whole output grows with the length.

The KV pool is sized so that nothing is preempted, and the step budget admits every prompt in
one step (no chunked prefill), so every scheduled request samples every step. The demo model's
byte-level tokenizer detokenizes the outputs (``--no-tokenizer``: none).

    python benchmarks/scripts/controller_step.py --label "before: cumulative outputs" \\
        --out docs/results/controller_step.md
    python benchmarks/scripts/controller_step.py --quick         # a few seconds

Only ``EngineCore(config, executor)``, ``add_request(AddRequest(...))`` and
``step()`` are used, and ``step()``'s return value is not inspected, so the script runs against
any engine core with that surface.
"""

from __future__ import annotations

import argparse
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from results_section import write_section

from pagedserve.config import from_flat
from pagedserve.controller.engine_core import EngineCore
from pagedserve.messages import (
    AddRequest,
    KVCacheLayout,
    LayerKVSpec,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
    WorkerReport,
)

FIRST_TOKEN = 3  # the demo vocabulary's ids 0-2 are special tokens
# Thread CPU time by default: on a shared machine, time spent descheduled is not the engine's.
CLOCKS = {"cpu": time.thread_time_ns, "wall": time.perf_counter_ns}

TITLE = "Controller cost per step as outputs grow"


class InstantExecutor:
    """An executor that samples one pseudo-random token per scheduled request and computes
    nothing. It counts the tokens it returned per request and the time spent in ``execute``."""

    def __init__(
        self, vocab_size: int, max_model_len: int, seed: int, clock: Callable[[], int]
    ) -> None:
        self.clock = clock
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.rng = random.Random(seed)
        self.emitted: dict[str, int] = {}
        self.calls = 0
        self.execute_ns = 0

    def initialize(self) -> WorkerReport:
        spec = LayerKVSpec(num_kv_heads=1, head_size=8, dtype_bytes=2)
        return WorkerReport([spec], 1 << 30, self.vocab_size, self.max_model_len, "cpu")

    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        self.layout = layout

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        t0 = self.clock()
        ids = list(scheduler_output.num_scheduled_tokens)
        hi = self.vocab_size - 1
        tokens = [[self.rng.randint(FIRST_TOKEN, hi)] for _ in ids]
        emitted = self.emitted
        for rid in ids:
            emitted[rid] = emitted.get(rid, 0) + 1
        out = ModelRunnerOutput(scheduler_output.step_id, ids, tokens)
        self.calls += 1
        self.execute_ns += self.clock() - t0
        return out

    def check_failure(self) -> None:
        return None

    def restart(self) -> WorkerReport:
        return self.initialize()

    def shutdown(self) -> None:
        pass


def build_engine(args: argparse.Namespace) -> tuple[EngineCore, InstantExecutor, str]:
    if args.no_tokenizer:
        # A directory without tokenizer files: the engine core loads no tokenizer from it.
        model, vocab, tok_name = tempfile.mkdtemp(prefix="no-tokenizer-"), 32000, "no tokenizer"
    else:
        from pagedserve.workers.demo import DEMO_VOCAB_SIZE, demo_checkpoint_dir

        model, vocab = str(demo_checkpoint_dir()), DEMO_VOCAB_SIZE
        tok_name = "the demo model's tokenizer"
    max_len = args.prompt_len + args.max_tokens
    blocks_per_req = -(-max_len // args.block_size)
    config = from_flat(
        model=model,
        block_size=args.block_size,
        num_gpu_blocks=args.requests * blocks_per_req + 1,  # + the null block
        max_model_len=max_len,
        max_num_seqs=args.requests,
        max_num_batched_tokens=max(2048, args.requests * args.prompt_len),
    )
    executor = InstantExecutor(vocab, max_len, args.seed, CLOCKS[args.clock])
    engine = EngineCore(config, executor)
    if args.no_tokenizer:
        shutil.rmtree(model, ignore_errors=True)
    return engine, executor, tok_name


def run(args: argparse.Namespace) -> tuple[list[tuple[int, float]], dict[str, float], str]:
    """One run: (output length after the step, controller µs) per step; totals; tokenizer."""
    engine, executor, tok_name = build_engine(args)
    rng = random.Random(args.seed)
    hi = executor.vocab_size - 1
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    t_start = time.perf_counter()
    for i in range(args.requests):
        prompt = [rng.randint(FIRST_TOKEN, hi) for _ in range(args.prompt_len)]
        engine.add_request(AddRequest(f"req-{i}", prompt, params))
    steps: list[tuple[int, float]] = []
    clock = CLOCKS[args.clock]
    first = "req-0"
    while executor.emitted.get(first, 0) < args.max_tokens:
        calls, exec_ns = executor.calls, executor.execute_ns
        t0 = clock()
        engine.step()
        dt = clock() - t0
        if executor.calls == calls:
            raise RuntimeError("a step ran no batch before the outputs were complete")
        steps.append((executor.emitted[first], (dt - (executor.execute_ns - exec_ns)) / 1000))
    counts = set(executor.emitted.values())
    if counts != {args.max_tokens}:
        raise RuntimeError(f"requests did not advance in lockstep: output lengths {counts}")
    controller_s = sum(us for _, us in steps) / 1e6
    totals = {
        "steps": float(len(steps)),
        "wall_s": time.perf_counter() - t_start,
        "controller_s": controller_s,
        "execute_s": executor.execute_ns / 1e9,
    }
    return steps, totals, tok_name


def table(steps: list[tuple[int, float]], lengths: list[int], window: int) -> list[str]:
    """Median over the steps whose output length is within ``window`` of each length (the
    first step, the prompts' prefill, never counts)."""
    medians = {
        n: statistics.median([us for k, us in steps if abs(k - n) <= window and k >= 2])
        for n in lengths
    }
    base = medians.get(16) or medians[lengths[0]]
    rows = ["| output length | median µs per step | vs 16 tokens |", "|---|---|---|"]
    rows += [f"| {n} | {medians[n]:.0f} | {medians[n] / base:.2f}x |" for n in lengths]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=64, help="running requests (default 64)")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--lengths", default="16,128,512,1024,2048", help="output lengths to report")
    ap.add_argument("--window", type=int, default=32, help="steps within this many tokens count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-tokenizer", action="store_true", help="no detokenization")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="this thread's CPU "
                    "time (default; steady on a shared machine) or wall-clock time")
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="runs; each step's time is its minimum over them (filters out other processes)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="48 tokens, lengths 16 and 32, window 8, one run"
    )
    ap.add_argument("--label", default="", help="names the run in the table's heading")
    ap.add_argument("--out", type=Path, help="write (or replace) this run's section in a file")
    args = ap.parse_args()
    if args.quick:
        args.max_tokens, args.lengths, args.repeats, args.window = 48, "16,32", 1, 8
    lengths = [int(x) for x in args.lengths.split(",")]
    if max(lengths) > args.max_tokens:
        ap.error(f"--lengths go past --max-tokens {args.max_tokens}")

    runs = [run(args) for _ in range(max(1, args.repeats))]
    # Every run does the same work step for step (seeded), so step i matches across runs.
    columns = zip(*(r[0] for r in runs), strict=True)
    steps = [(col[0][0], min(us for _, us in col)) for col in columns]
    _, totals, tok_name = runs[0]
    rows = table(steps, lengths, args.window)
    command = "python benchmarks/scripts/controller_step.py " + " ".join(
        f'"{a}"' if " " in a else a for a in sys.argv[1:]
    )
    body = [
        f"`{command}`",
        "",
        f"{args.requests} requests, {args.prompt_len}-token prompts, max_tokens="
        f"{args.max_tokens}, ignore_eos, block size {args.block_size}, {tok_name}. "
        f"Controller time per step ({args.clock} clock) = `step()` minus the fake executor's "
        f"`execute`, minimum over {len(runs)} runs; median over the steps within "
        f"{args.window} tokens of each output length.",
        "",
        *rows,
        "",
        f"One run: {totals['steps']:.0f} steps in {totals['wall_s']:.1f} s, controller "
        f"{totals['controller_s']:.2f} s, fake executor {totals['execute_s']:.2f} s. "
        f"Python {platform.python_version()}, {platform.machine()}.",
    ]
    heading = f"controller step cost, {args.requests} running" + (
        f" ({args.label})" if args.label else ""
    )
    print(f"\n{heading}\n")
    print("\n".join(body))
    if args.out:
        label = args.label or "unlabelled"
        write_section(args.out, label, [f"## {label}", "", *body], TITLE)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
