"""Where a step's time goes: a py-spy sampling profile of the in-process engine on the peers
workload (``benchmarks/scripts/peers.py``), each sample filed under the innermost part it is in.

Parts: the linear layers (GEMMs, lm head included), attention split into the compiled CPU kernel
(float32), or on the torch path the K/V gather through the block table, the attention math, the
scatter of its output and the plan (indices, masks), the cache write, norms, rotary, the
activation, the embedding, per-layer Python (module calls, views), sampling, input preparation (the
model runner), the scheduler, the controller's output building and detokenization; a layer that
runs as one compiled call (``kernels/decoder_layer.py``) is one part, which ``layer_step.py
--profile`` splits by operator. Samples outside the engine's step loop (start-up, model loading)
are left out. py-spy is ``pip install py-spy``; the profiled process runs ``generate`` once.

    python benchmarks/scripts/profile_step.py --model llama-22m
    python benchmarks/scripts/profile_step.py --model demo --out docs/results/performance.md
"""

from __future__ import annotations

import argparse
import collections
import json
import linecache
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pagedserve.benchmarks.report import emit_table

HERE = Path(__file__).resolve().parent
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]+):(?P<line>\d+)\)$")

# (part, function name, file suffix or None); the innermost frame that matches names the part.
RULES: list[tuple[str, str, str | None]] = [
    ("sampling", "Sampler.", "workers/sampler.py"),
    ("compiled decoder layers (matmuls, attention, pointwise; layer_step.py --profile splits "
     "them)", "decoder_layer", "kernels/decoder_layer.py"),
    ("attention: compiled CPU kernel", "cpu_paged_attention", "kernels/cpu.py"),
    ("attention: plan (indices, masks)", "", "kernels/reference.py:plan"),
    ("attention: math (SDPA / matmul)", "_attend", "kernels/reference.py"),
    ("attention: K/V gather", "", "kernels/reference.py:index_select"),
    ("attention: output scatter", "", "kernels/reference.py:out["),
    ("cache write", "reshape_and_cache", None),
    ("linear layers (GEMM)", "linear", "kernels/linear.py"),
    ("linear layers (GEMM)", "", "kernels/quant_linear.py"),
    ("linear layers (GEMM)", "Linear.forward", "parallel/linear.py"),
    ("linear layers (GEMM)", "ParallelLMHead", "parallel/linear.py"),
    ("embedding", "VocabParallelEmbedding", "parallel/linear.py"),
    ("norms", "RMSNorm.", None),
    ("rotary", "Rotary", None),
    ("rotary", "_rotate", None),
    ("rotary", "rotary", "kernels/layer_ops.py"),
    ("norms", "rms_norm", "kernels/layer_ops.py"),
    ("activation", "silu_and_mul", "kernels/layer_ops.py"),
    ("activation", "SiluAndMul", None),
    ("attention: other (checks, views)", "", "kernels/"),
    ("attention: other (checks, views)", "PagedAttention.forward", None),
    ("per-layer Python (module calls, views)", "", "workers/models/"),
    ("input preparation (model runner)", "", "workers/"),
    ("detokenization", "", "controller/tokenizer.py"),
    ("scheduler", "", "controller/scheduler.py"),
    ("scheduler", "", "kv/"),
    ("output building", "", "controller/"),
]


def classify(stack: list[str]) -> str | None:
    """The part of one sample (frames outermost first), None outside the step loop."""
    if not any(f.startswith("EngineLoop._run") for f in stack):
        return None
    for frame in reversed(stack):
        m = _FRAME.match(frame)
        if m is None:
            continue
        func, file, line = m["func"], m["file"], int(m["line"])
        for part, name, where in RULES:
            path, _, marker = (where or "").partition(":")
            if name and name not in func:
                continue
            if path and not file.endswith(path) and f"/{path}" not in file:
                continue
            if marker and marker not in _source(file, line, func):
                continue
            return part
    return "other (torch dispatch, Python)"


def _source(file: str, line: int, func: str) -> str:
    """The function name for the ``plan`` marker, else the sampled source line."""
    if func.startswith(("plan_paged_attention", "_plan_launch")):
        return "plan"
    return linecache.getline(_resolve(file), line)


def _resolve(file: str) -> str:
    # py-spy shortens paths; the repository's own files are found from here.
    for root in (HERE.parent, HERE.parent.parent):
        cand = root / file
        if cand.exists():
            return str(cand)
    return file


def profile(args: argparse.Namespace) -> collections.Counter[str]:
    spy = shutil.which("py-spy")
    if spy is None:
        sys.exit("py-spy is not installed: pip install py-spy")
    with tempfile.TemporaryDirectory(prefix="pagedserve-profile-") as tmp:
        raw = Path(tmp) / "raw.txt"
        cmd = [spy, "record", "-r", str(args.rate), "-f", "raw", "--full-filenames", "-o",
               str(raw), "--", sys.executable, str(Path(__file__).resolve()), "--child",
               "--model", args.model, "--num-requests", str(args.num_requests),
               "--dtype", args.dtype, "--quantization", args.quantization]
        subprocess.run(cmd, cwd=tmp, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": ""})
        counts: collections.Counter[str] = collections.Counter()
        for line in raw.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            part = classify(stack.split(";"))
            if part is not None:
                counts[part] += int(n)
    return counts


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))
    import peers
    from transformers import AutoConfig

    mdir = peers.model_dir(args.model)
    vocab = AutoConfig.from_pretrained(mdir).vocab_size
    work = peers.make_workload(args.num_requests, (16, 256), (16, 256), vocab, 0)
    peers.run_pagedserve(str(mdir), work, "local", args.dtype, args.quantization)
    print(json.dumps({"elapsed_s": work["elapsed_s"]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-22m")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default="none",
                    help="the engine's quantization (none: the checkpoint's own weights)")
    ap.add_argument("--rate", type=int, default=200, help="samples per second")
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    counts = profile(args)
    total = sum(counts.values()) or 1
    lines = [f"model `{args.model}`, {args.num_requests} requests (peers workload), in-process "
             f"engine, {args.dtype}, quantization {args.quantization}, {total} samples in the "
             f"step loop", "", "| part | share of step time |", "|---|---|"]
    lines += [f"| {part} | {n / total:.1%} |" for part, n in counts.most_common()]
    table = "\n".join(lines) + "\n"
    emit_table(table, args.out)


if __name__ == "__main__":
    main()
