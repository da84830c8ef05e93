"""One request at a time, pagedserve's variants side by side in one process, request by request.

``single_stream.py`` starts a fresh process per engine and takes turns by the round, so on a
host whose memory bandwidth drifts by a third from minute to minute its rounds differ more than
the engines do. Here every variant is built once in this process and they take turns request
by request (``--rounds`` turns): within a turn they run seconds apart, and the ratios are taken
within each turn, then their median. At most one variant runs in this process: two in-process
engines each keep a team of OpenMP threads, whose spinning after a step slows the other one
(both read about half their speed when built together); compare ``local-1pass`` in a run of
its own against the same Ray variant. Variants:

  ray           ``LLM()`` on Ray (controller and worker actors)
  ray-1pass     the same with ``num_scheduler_steps=1``: one decode pass per step message
  local         the engine in this process
  local-1pass   the same with one decode pass per step

Each turn: a ``--prompt``-token prompt (rotated anew each call, so no prefix-cache hit) to 1 new
token, then another to ``--new`` tokens with ``ignore_eos``; decode tok/s is the tokens after
the first over the time the longer call took beyond the shorter. Idle variants cost nothing:
an idle Ray worker waits in a receive.

    python benchmarks/scripts/batch1_paired.py --model smollm2 --dtype bfloat16 --rounds 20
    python benchmarks/scripts/batch1_paired.py --variants ray,local-1pass --rounds 20
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peers import model_dir  # noqa: E402
from single_stream import distinct, timed  # noqa: E402

from pagedserve.benchmarks.report import emit_table  # noqa: E402

VARIANTS = {
    "ray": {},
    "ray-1pass": {"num_scheduler_steps": 1},
    "local": {"backend": "local"},
    "local-1pass": {"backend": "local", "num_scheduler_steps": 1},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--variants", default="ray,ray-1pass,local")
    ap.add_argument("--quantization", default="none",
                    help="pagedserve's (none: the checkpoint's weights at --dtype)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    args = ap.parse_args()
    names = args.variants.split(",")
    if unknown := set(names) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    if sum(n.startswith("local") for n in names) > 1:
        ap.error("at most one in-process variant per run (see the module docstring)")
    from transformers import AutoConfig

    from pagedserve import LLM, SamplingParams

    mdir = model_dir(args.model)
    vocab = AutoConfig.from_pretrained(mdir).vocab_size
    rng = random.Random(0)
    prompts = distinct([rng.randrange(3, vocab) for _ in range(args.prompt)])
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    llms = {n: LLM(str(mdir), dtype=args.dtype, quantization=args.quantization, **VARIANTS[n])
            for n in names}
    try:
        for llm in llms.values():  # warm-up
            llm.generate([next(prompts)], many, use_tqdm=False)
        tg: dict[str, list[float]] = {n: [] for n in names}
        pp: dict[str, list[float]] = {n: [] for n in names}
        for rnd in range(args.rounds):
            for n, llm in llms.items():
                t_pp = timed(lambda llm=llm: llm.generate([next(prompts)], one, use_tqdm=False))
                t_tg = timed(lambda llm=llm: llm.generate([next(prompts)], many, use_tqdm=False))
                tg[n].append((args.new - 1) / (t_tg - t_pp))
                pp[n].append(args.prompt / t_pp)
            print(f"round {rnd + 1}: " + ", ".join(f"{n} {tg[n][-1]:.1f}" for n in names),
                  flush=True)
    finally:
        for llm in llms.values():
            llm.shutdown()
    base = "local" if "local" in names else names[0]
    med = statistics.median
    rows = [f"model `{args.model}`, {args.dtype} (quantization {args.quantization}), one "
            f"request: {args.prompt}-token prompt, {args.new} new tokens, greedy; {args.rounds} "
            "turns of every variant, request by request, in one process; medians, ratios within "
            "each turn", "",
            f"| variant | decode tok/s | ms/token | p10-p90 tok/s | ratio to {base} "
            "(median of the turns') | prefill tok/s |",
            "|---|---|---|---|---|---|"]
    for n in names:
        q = statistics.quantiles(tg[n], n=10)
        ratio = med(a / b for a, b in zip(tg[n], tg[base], strict=True))
        rows.append(f"| {n} | {med(tg[n]):.1f} | {1e3 / med(tg[n]):.2f} | {q[0]:.0f}-{q[-1]:.0f} "
                    f"| {ratio:.3f}x | {med(pp[n]):.0f} |")
    emit_table("\n".join(rows) + "\n", args.out)


if __name__ == "__main__":
    main()
