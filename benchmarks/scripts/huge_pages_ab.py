"""Weights in 2 MiB pages against 4 KiB pages, paired in one process.

Two in-process engines of the same model: one as the engine builds it (weights collapsed into
2 MiB pages after loading: ``workers/huge_pages.py``), one with the collapse turned off. Each
round runs ``--requests`` requests of a ``--prompt``-token prompt to ``--new`` greedy tokens
on each engine in turn (the order alternating), so both see the same moment of this host's
drifting memory bandwidth; the table gives each round's decode tok/s (the steps after every
request has its first token) and the median of the per-round ratios.

    python benchmarks/scripts/huge_pages_ab.py --model smollm2 --dtype bfloat16 --rounds 10
    python benchmarks/scripts/huge_pages_ab.py --requests 64 --new 64 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peers import model_dir  # noqa: E402

from pagedserve.benchmarks.report import emit_table  # noqa: E402


def build(mdir: Path, args: argparse.Namespace, huge: bool):  # type: ignore[no-untyped-def]
    from pagedserve.builder import build_engine
    from pagedserve.config import from_flat
    from pagedserve.workers import huge_pages

    config = from_flat(model=str(mdir), dtype=args.dtype, quantization=args.quantization,
                       kv_cache_memory_bytes=args.kv_mib << 20)
    if huge:
        return build_engine(config)
    with mock.patch.object(huge_pages, "collapse", lambda tensors: 0):
        return build_engine(config)


def decode_tok_s(engine, prompts: list[list[int]], new: int, tag: str) -> float:  # type: ignore[no-untyped-def]
    """Output tokens over the time from when every request has its first token (the prefill
    steps left out) to the end."""
    from pagedserve import SamplingParams
    from pagedserve.messages import AddRequest

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(AddRequest(f"{tag}-{i}", p, params))
    started: set[str] = set()
    while len(started) < len(prompts):
        started.update(d.request_id for d in engine.step())
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(c.token_ids) for d in engine.step() for c in d.completions)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--kv-mib", type=int, default=512, help="each engine's KV pool")
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    args = ap.parse_args()

    import random

    mdir = model_dir(args.model)
    engines = {"4 KiB pages": build(mdir, args, huge=False),
               "2 MiB pages": build(mdir, args, huge=True)}
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(mdir).vocab_size
    rng = random.Random(0)
    runs: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for rnd in range(args.rounds + 1):  # round 0 warms both up and is left out
        order = names if rnd % 2 else names[::-1]
        for name in order:
            # Fresh prompts each time: no prefix-cache hit on an earlier round's blocks.
            prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt)]
                       for _ in range(args.requests)]
            tok_s = decode_tok_s(engines[name], prompts, args.new, f"{name[0]}{rnd}")
            if rnd:
                runs[name].append(tok_s)
        if rnd:
            print(f"round {rnd}: " + ", ".join(f"{n} {runs[n][-1]:.1f}" for n in names),
                  flush=True)
    base = runs[names[0]]
    rows = [f"model `{args.model}`, {args.dtype} (quantization {args.quantization}), in-process "
            f"engines in one process, {args.requests} request(s) of {args.prompt} prompt tokens "
            f"to {args.new} new tokens, greedy, {args.rounds} rounds taking turns", "",
            "| pages | decode tok/s (median) | per round | ratio to 4 KiB pages (median of "
            "rounds) |", "|---|---|---|---|"]
    for name in names:
        rs = runs[name]
        ratio = statistics.median(r / b for r, b in zip(rs, base, strict=True))
        rows.append(f"| {name} | {statistics.median(rs):.1f} | "
                    f"{', '.join(f'{r:.1f}' for r in rs)} | {ratio:.2f}x |")
    emit_table("\n".join(rows) + "\n", args.out)


if __name__ == "__main__":
    main()
