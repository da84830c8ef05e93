"""Speculative decoding on a copy-heavy workload: output tok/s with prompt-lookup and suffix
drafts against none, at a given concurrency, one process, one model.

The workload is what prompt lookup is for: chat prompts that ask the model to repeat, or
lightly edit, a passage of code taken from Python's standard library (``inspect.getsource`` of
a few functions, so the text is the same on every machine with this Python), greedy, up to
``--max-tokens`` each. Every configuration runs the same requests ``--concurrency`` at a time
(a new one starts as one finishes: ``LLM.generate`` over all of them with ``max_num_seqs`` set
to the concurrency), after a warm-up; the configurations alternate over ``--rounds`` and each
ratio is taken within a round. Reported per proposer: output tok/s, the ratio to no
speculation, the acceptance rate (accepted / proposed draft tokens), tokens per verify step (1
+ accepted drafts per request-step that had drafts), and whether every output is identical to
the run without speculation (greedy: it must be).

``--draft-layers N`` adds a draft model: the target's first N decoder layers with its own
embedding, final norm and head (an early exit, untrained as a draft: written once into the
cache), the only smaller checkpoint with SmolLM2's tokenizer at hand.

    python benchmarks/scripts/speculative.py --concurrency 1
    python benchmarks/scripts/speculative.py --concurrency 8 --out docs/results/speculative.md
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peers import model_dir  # noqa: E402

from pagedserve.benchmarks.report import emit_table  # noqa: E402

METHODS: dict[str, dict | None] = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2,
              "prompt_lookup_max": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 16},
}
# Standard-library functions of a few dozen lines each: code a user pastes and asks about.
SOURCES = ("textwrap.dedent", "json.decoder.py_scanstring", "shlex.split", "fnmatch.translate",
           "urllib.parse.urljoin", "base64.b64decode", "string.capwords", "heapq.merge",
           "difflib.get_close_matches", "calendar.monthrange", "colorsys.rgb_to_hls",
           "ipaddress.ip_address")
TASKS = (
    "Repeat the following code exactly, with no comment before or after it:\n\n{code}",
    "Rewrite the following code with every comment removed, changing nothing else:\n\n{code}",
    "Copy this function, renaming its first parameter to `value`:\n\n{code}",
)


def draft_dir(target: Path, layers: int) -> Path:
    """The target's first ``layers`` decoder layers as a checkpoint of their own (written once
    into the cache): same embedding, final norm, head and tokenizer."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pagedserve.config import cache_root

    out = cache_root() / f"{target.name}-first{layers}layers"
    if (out / "model.safetensors").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    keep = {k: v for k, v in load_file(str(target / "model.safetensors")).items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, str(tmp / "model.safetensors"))
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "generation_config", "chat_template")):
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return out


def _source(dotted: str) -> str:
    import importlib

    module, name = dotted.rsplit(".", 1)
    return inspect.getsource(getattr(importlib.import_module(module), name))


def prompts(n: int) -> list[str]:
    return [TASKS[i % len(TASKS)].format(code=_source(SOURCES[i % len(SOURCES)]))
            for i in range(n)]


def run(model: str, method: str, texts: list[str], args: argparse.Namespace) -> dict:
    """One configuration on a fresh engine (only one engine runs at a time)."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(model, backend=args.backend, dtype=args.dtype, quantization=args.quantization,
              max_num_seqs=args.concurrency,
              enable_prefix_caching=False, speculative_config=METHODS[method])
    try:
        llm.chat([[{"role": "user", "content": texts[0]}]],
                 SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)  # warm-up
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        before = llm.stats()
        t0 = time.perf_counter()
        outs = llm.chat([[{"role": "user", "content": t}] for t in texts], params,
                        use_tqdm=False)
        elapsed = time.perf_counter() - t0
        after = llm.stats()
    finally:
        llm.shutdown()

    def delta(key: str) -> int:
        return int(after.get(key, 0) - before.get(key, 0))

    return {"elapsed_s": elapsed, "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "drafts": delta("spec_decode_num_drafts"),
            "draft_tokens": delta("spec_decode_num_draft_tokens"),
            "accepted": delta("spec_decode_num_accepted_tokens")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--quantization", default="none",
                    help="none: the checkpoint's weights at --dtype (the GGUF default model "
                         "would otherwise run its 4-bit blocks)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--backend", default=None, choices=("ray", "local"),
                    help="default: the engine's default (Ray)")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="default: 4 at concurrency 1, else 2 x the concurrency")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--methods", default="none,ngram,suffix")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--draft-layers", type=int, default=None, metavar="N",
                    help="also a draft model: the target's first N layers")
    ap.add_argument("--num-draft-tokens", type=int, default=4,
                    help="the draft model's num_speculative_tokens")
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    args = ap.parse_args()
    methods = args.methods.split(",")
    if methods[0] != "none":
        raise SystemExit("--methods must start with none (the baseline of the ratios)")
    n = args.num_requests or (4 if args.concurrency == 1 else 2 * args.concurrency)
    texts = prompts(n)
    model = str(model_dir(args.model))
    if args.draft_layers is not None:
        METHODS["draft_model"] = {
            "method": "draft_model", "model": str(draft_dir(Path(model), args.draft_layers)),
            "num_speculative_tokens": args.num_draft_tokens}
        methods.append("draft_model")
    rounds: list[dict[str, dict]] = []
    for r in range(args.rounds):
        order = methods if r % 2 == 0 else methods[::-1]
        rounds.append({m: run(model, m, texts, args) for m in order})
    table(args, methods, rounds, n)


def table(args: argparse.Namespace, methods: list[str], rounds: list[dict], n: int) -> None:
    tokens = [sum(len(o) for o in r["none"]["outputs"]) for r in rounds]
    lines = [f"model `{args.model}`, {args.dtype}, quantization {args.quantization}, {n} "
             f"copy-and-edit chat requests at concurrency {args.concurrency}, greedy, up to "
             f"{args.max_tokens} new tokens "
             f"({tokens[0]} in all), {len(rounds)} round(s)", "",
             "| drafts | config | output tok/s (median) | ratio to none (median) "
             "| acceptance rate | tokens per verify step | identical to none |",
             "|---|---|---|---|---|---|---|"]
    for m in methods:
        tps = [sum(len(o) for o in r[m]["outputs"]) / r[m]["elapsed_s"] for r in rounds]
        ratios = [r["none"]["elapsed_s"] / r[m]["elapsed_s"] for r in rounds]
        drafts = sum(r[m]["drafts"] for r in rounds)
        proposed = sum(r[m]["draft_tokens"] for r in rounds)
        accepted = sum(r[m]["accepted"] for r in rounds)
        rate = f"{accepted / proposed:.1%}" if proposed else "-"
        per_step = f"{1 + accepted / drafts:.2f}" if drafts else "-"
        same = sum(a == b for r in rounds
                   for a, b in zip(r[m]["outputs"], r["none"]["outputs"], strict=True))
        shown = METHODS[m]
        if shown is not None and "model" in shown:  # the cache path, by its name only
            shown = {**shown, "model": Path(shown["model"]).name}
        config = "-" if shown is None else f"`{json.dumps(shown)}`"
        lines.append(f"| {m} | {config} | {statistics.median(tps):.1f} | "
                     f"{statistics.median(ratios):.2f}x | {rate} | {per_step} | "
                     f"{same}/{n * len(rounds)} |")
    emit_table("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
