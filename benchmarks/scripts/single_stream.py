"""One request at a time: batch-1 decode and a 128-token prefill, against the memory roof.

Per engine, in a fresh process each: one prompt of ``--prompt`` random token ids, generated
greedily to 1 new token (the prefill, ``pp``) and to ``--new`` new tokens with ``ignore_eos``
(``tg``: the tokens after the first, over the time the longer run took beyond the shorter),
best of ``--repeats``; every call's prompt is the same tokens rotated anew, so no call finds
an earlier one's blocks in a prefix cache. This host's memory bandwidth drifts by a third
from minute to minute, so the engines take turns: ``--rounds`` rounds of every engine once,
the table gives medians and each round's figure, and the ratios to llama.cpp are taken
within a round. Engines:

  pagedserve        ``LLM()`` on Ray (controller and worker actors)
  pagedserve-local  the engine in the benchmark's process
  pagedserve-sync   ``LLM()`` on Ray with ``async_scheduling=False`` (each step scheduled after
                    the one before is back)
  pagedserve-1pass  ``LLM()`` on Ray with ``num_scheduler_steps=1`` (one decode pass per
                    step message; ``pagedserve-local-1pass`` in-process)
  base, base-local  the same from ``--baseline-venv`` (another checkout installed there)
  vllm              vLLM's CPU build from ``--vllm-venv``, its worker bound to every core
  llama.cpp         ``llama-bench -p PROMPT -n NEW`` from ``--llama-bench`` on ``--llama-model``
                    (a GGUF of the same weights at the same dtype); skipped without them

The memory roof: at batch 1 a decode step reads every weight once, so tokens/s x the model's
weight bytes at the dtype is the bandwidth it implies; the table gives it against a read
bandwidth probe run in this same script (a sum over a buffer far larger than the caches).

The engine's own cost: ``pagedserve-local`` also reports the worker's share of a decode step
(``ModelRunner.execute``: input preparation, the forward pass, sampling), from the engine's
``time_execute_s`` over the decode passes; each pagedserve row's "over the step" column is its
time per token minus that, the controller's and the transport's share of the critical path.
On the Ray path the last column is the CPU time per decoded token of the processes beside the
worker (``/proc``, over the timed decode runs): the controller actor, this client process and
Ray's own services. On two cores every millisecond of it is taken from the worker's threads.

    python benchmarks/scripts/single_stream.py --model smollm2 --dtype bfloat16
    python benchmarks/scripts/single_stream.py --vllm-venv /path/to/vllm-venv --out FILE.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peers import model_dir  # noqa: E402
from proc_cpu import cpu_by_role, cpu_seconds  # noqa: E402

from pagedserve.benchmarks.report import emit_table  # noqa: E402


def read_bandwidth_gbs(mb: int = 512, repeats: int = 5) -> float:
    """Bytes/s of a float32 sum over ``mb`` MiB, best of ``repeats``, in GB/s."""
    import torch

    x = torch.ones(mb * 2**20 // 4)
    x.sum()
    best = min(timed(x.sum) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def weight_bytes(mdir: Path, dtype: str, quantization: str = "none") -> int:
    """The bytes a batch-1 decode step reads: every parameter but the input embedding (one row
    of it is read; a tied LM head reads the table once, as the head); with ``int8`` every
    matrix (the projections and the head) at one byte an element."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(mdir))
    emb = m.get_input_embeddings().weight
    n = sum(p.numel() for p in m.parameters())  # tied weights are listed once
    tied = m.get_output_embeddings().weight is emb
    per = 2 if dtype == "bfloat16" else 4
    total = (n - (0 if tied else emb.numel())) * per
    if quantization == "int8":
        matrices = sum(p.numel() for p in m.parameters() if p.dim() == 2)
        total -= (matrices - (0 if tied else emb.numel())) * (per - 1)
    return total


def distinct(prompt: list[int]):
    """The prompt rotated by one more token each time: every call prefills all of its tokens
    (no prefix-cache hit on an earlier call's blocks), at the same length."""
    k = 0
    while True:
        yield prompt[k % len(prompt):] + prompt[:k % len(prompt)]
        k += 1


# -- one engine, in its own process ------------------------------------------------------------

def child_pagedserve(args: argparse.Namespace) -> dict:
    from pagedserve import LLM, SamplingParams

    options: dict = {} if args.async_scheduling is None else {
        "async_scheduling": args.async_scheduling}
    if args.num_scheduler_steps is not None:
        options["num_scheduler_steps"] = args.num_scheduler_steps
    llm = LLM(args.model_dir, backend=args.backend, dtype=args.dtype,
              quantization=args.quantization, **options)
    try:
        prompts = distinct(json.loads(args.prompt_ids))
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        many = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
        llm.generate([next(prompts)], many, use_tqdm=False)  # warm-up

        def timed_runs(params: SamplingParams) -> tuple[float, float, int]:
            """Best wall time of the runs, and the executor's time over all of them."""
            s0 = llm.stats()
            best = min(timed(lambda: llm.generate([next(prompts)], params, use_tqdm=False))
                       for _ in range(args.repeats))
            return best, llm.stats()["time_execute_s"] - s0["time_execute_s"]

        pp, pp_exec = timed_runs(one)
        cpu0 = cpu_seconds()
        tg, tg_exec = timed_runs(many)
        cpu = cpu_by_role(cpu0, cpu_seconds())
        # A decode pass each for the long runs' tokens after the first (a step may run
        # several: num_scheduler_steps); the prefills are the short runs'.
        tokens = args.repeats * args.new
        step_s = (tg_exec - pp_exec) / max(1, tokens - args.repeats)
        return {"pp_s": pp, "tg_s": tg, "step_s": step_s,
                "cpu_ms": {role: 1e3 * s / tokens for role, s in cpu.items()}}
    finally:
        llm.shutdown()


def run_engine(engine: str, args: argparse.Namespace, mdir: Path, prompt: list[int],
               cwd: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ""}
    if engine == "vllm":
        env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        payload = json.dumps({"model": str(mdir), "dtype": args.dtype, "prompt": prompt,
                              "new": args.new, "repeats": args.repeats})
        cmd = [str(Path(args.vllm_venv) / "bin" / "python"),
               str(HERE / "peers" / "vllm_single_stream.py"), payload]
    else:
        py = Path(args.baseline_venv) / "bin" / "python" if engine.startswith("base") else None
        cmd = [str(py or sys.executable), str(Path(__file__).resolve()), "--child",
               "--model-dir", str(mdir), "--dtype", args.dtype, "--new", str(args.new),
               "--repeats", str(args.repeats), "--quantization", args.quantization,
               "--backend", "local" if "-local" in engine else "ray",
               *(["--no-async-scheduling"] if "-sync" in engine else []),
               *(["--num-scheduler-steps", "1"] if "-1pass" in engine else []),
               "--prompt-ids", json.dumps(prompt)]
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=True)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def run_llama_bench(args: argparse.Namespace) -> dict | None:
    if not (args.llama_bench and args.llama_model):
        print("llama.cpp: skipped (give --llama-bench PATH and --llama-model FILE.gguf)")
        return None
    out = subprocess.run([args.llama_bench, "-m", args.llama_model, "-p", str(args.prompt),
                          "-n", str(args.new), "-t", str(os.cpu_count()), "-o", "json"],
                         capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    return {"pp_tok_s": pp, "tg_tok_s": tg}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default="none",
                    help="pagedserve's (none: the checkpoint's weights, as the peers load them)")
    ap.add_argument("--engines", default="pagedserve,pagedserve-local")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3,
                    help="turns of every engine (medians and per-round ratios are reported)")
    ap.add_argument("--vllm-venv")
    ap.add_argument("--baseline-venv")
    ap.add_argument("--llama-bench")
    ap.add_argument("--llama-model")
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_const",
                    const=False, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--num-scheduler-steps", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT", json.dumps(child_pagedserve(args)), flush=True)
        return
    engines = args.engines.split(",")
    engines += ["vllm"] if args.vllm_venv else []
    engines += ["base", "base-local"] if args.baseline_venv else []
    engines = list(dict.fromkeys(engines))  # each once, though named twice
    mdir = model_dir(args.model)
    import random

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(mdir).vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(3, vocab) for _ in range(args.prompt)]  # ids 0-2: special
    roof = read_bandwidth_gbs()
    wbytes = weight_bytes(mdir, args.dtype, args.quantization)
    # Per engine, per round: decode tok/s, prefill tok/s and (pagedserve) the worker's step.
    runs: dict[str, list[dict]] = {e: [] for e in [*engines, "llama.cpp"]}
    with tempfile.TemporaryDirectory() as cwd:
        for rnd in range(args.rounds):
            for engine in engines:
                r = run_engine(engine, args, mdir, prompt, cwd)
                runs[engine].append({"tg": (args.new - 1) / (r["tg_s"] - r["pp_s"]),
                                     "pp": args.prompt / r["pp_s"], "step_s": r.get("step_s"),
                                     "cpu_ms": r.get("cpu_ms")})
                print(f"round {rnd + 1} {engine}: {runs[engine][-1]}", flush=True)
            lc = run_llama_bench(args)
            if lc is not None:
                runs["llama.cpp"].append({"tg": lc["tg_tok_s"], "pp": lc["pp_tok_s"]})
                print(f"round {rnd + 1} llama.cpp: {runs['llama.cpp'][-1]}", flush=True)
    if not runs["llama.cpp"]:
        del runs["llama.cpp"]
    local_step = runs.get("pagedserve-local", [{}])
    rows = [f"model `{args.model}`, {args.dtype} (pagedserve quantization {args.quantization}), "
            f"one request: {args.prompt}-token prompt, {args.new} new tokens, greedy, best of "
            f"{args.repeats}, {args.rounds} round(s) taking turns, medians; weights read per "
            f"decode step {wbytes / 1e6:.0f} MB; read bandwidth probe {roof:.1f} GB/s", "",
            "| engine | decode tok/s | per round | ms/token | over the local worker step "
            "(ms) | implied GB/s, share of the probe | prefill tok/s (pp) | decode vs "
            "llama.cpp | CPU ms/token beside the worker: controller, client, Ray |",
            "|---|---|---|---|---|---|---|---|---|"]
    median = statistics.median
    for engine, rs in runs.items():
        tg = median(r["tg"] for r in rs)
        per_round = ", ".join(f"{r['tg']:.1f}" for r in rs)
        over = ratio = cpu = "-"
        if rs[0].get("cpu_ms") and "-local" not in engine:  # the Ray path's
            cpu = ", ".join(f"{median(r['cpu_ms'][role] for r in rs):.2f}"
                            for role in ("controller", "client", "ray services"))
        if engine.startswith("pagedserve") and local_step[0].get("step_s"):
            # Within each round: this engine's time per token less the local worker's step.
            pairs = zip(rs, local_step, strict=True)
            over = f"{median(1e3 / r['tg'] - 1e3 * s['step_s'] for r, s in pairs):.2f}"
        if "llama.cpp" in runs:
            pairs = zip(rs, runs["llama.cpp"], strict=True)
            ratio = f"{median(r['tg'] / c['tg'] for r, c in pairs):.2f}x"
        gbs = tg * wbytes / 1e9
        rows.append(f"| {engine} | {tg:.1f} | {per_round} | {1e3 / tg:.2f} | {over} | "
                    f"{gbs:.1f}, {gbs / roof:.0%} | {median(r['pp'] for r in rs):.0f} | "
                    f"{ratio} | {cpu} |")
    if local_step[0].get("step_s"):
        steps = [1e3 * s["step_s"] for s in local_step]
        rows += ["", f"The local worker's decode step (`ModelRunner.execute`): "
                 f"{statistics.median(steps):.2f} ms (rounds: "
                 f"{', '.join(f'{s:.2f}' for s in steps)})."]
    emit_table("\n".join(rows) + "\n", args.out)


if __name__ == "__main__":
    main()
