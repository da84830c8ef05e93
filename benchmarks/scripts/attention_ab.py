"""The CPU paged-attention kernel against its own source at another revision, in one process.

Each revision's ``kernels/csrc/paged_attention_cpu.cpp`` (the working tree's, and the one ``git
show REV:...`` gives) is built as its own extension, its op registered under a namespace of its
own, with that revision's headers (``csrc/*.h``) and the library's compiler flags; the two then
take the same decode steps call by call, alternating (``cpu_kernels.time_alternating``), so that
a noisy machine's drift hits both. A step is S sequences of one new token after ``ctx`` cached
tokens (SmolLM2's heads by default: 9 query heads over 3 kv heads of 64), block size 16. Prints
each revision's median time, their ratio and the largest difference between their outputs.

With ``--layers N`` a step holds N caches, one per layer as a model's forward has, and a timed
call runs the N layers in turn (the table gives the time a layer): at N = 30 SmolLM2's 64 x 128
step reads 190 MB of K and V, far more than the last-level cache, so it measures the kernel as
a forward pass sees it, its cache reads coming from memory; at N = 1 the same few MB stay in
cache from call to call.

A step's blocks are consecutive in the pool by default; ``--scatter`` hands them out in a
random order instead, as a pool does once sequences have grown block by block side by side.

    python benchmarks/scripts/attention_ab.py --baseline HEAD~1
    python benchmarks/scripts/attention_ab.py --baseline HEAD~1 --threads 2 --layers 30
    python benchmarks/scripts/attention_ab.py --baseline HEAD~1 --threads 2 --dtype float32
    python benchmarks/scripts/attention_ab.py --baseline HEAD --threads 2 --layers 30 --scatter
    python benchmarks/scripts/attention_ab.py --baseline HEAD --threads 2 --layers 30 \
        --kv-cache-dtype fp8_e4m3

``--kv-cache-dtype fp8_e4m3`` gives the working tree's kernel the same keys and values in a
scaled fp8 cache (``kernels.kv_quant``), while the baseline's reads them at ``--dtype``: with
``--baseline HEAD``, one kernel over a cache of either dtype (the output difference is then the
fp8 rounding's).
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import tempfile
from pathlib import Path

import torch
from cpu_kernels import build_revision, time_alternating

from pagedserve.kernels.kv_quant import FP8_E4M3, quantize_kv, scale_from_amax

REPO = Path(__file__).resolve().parents[2]
SOURCE = "kernels/csrc/paged_attention_cpu.cpp"


def run_layers(op: object, q: torch.Tensor, caches: list[torch.Tensor], out: torch.Tensor,
               *meta: object) -> None:
    """One decode step's attention in every layer: the op over each cache in turn."""
    for cache in caches:
        op(q, cache, out, *meta)  # type: ignore[operator]


def meta_args(op: object, cu: torch.Tensor, lens: torch.Tensor, table: torch.Tensor,
              scale: float, kv_scale: float) -> tuple:
    """The op's arguments after q, cache and out, as its revision's schema has them (the cache's
    k_scale and v_scale since they were added)."""
    names = [a.name for a in op.default._schema.arguments]  # type: ignore[attr-defined]
    scales = (kv_scale, kv_scale) if "k_scale" in names else ()
    return (cu, lens, table, scale, -1, *scales, torch.empty(0))


def _git(*cmd: str) -> str:
    return subprocess.run(["git", *cmd], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout


def _headers_at(rev: str, dest: Path) -> Path:
    """The kernel headers (``kernels/csrc/*.h``) as they are at ``rev``, written into ``dest``."""
    dest.mkdir()
    csrc = str(Path(SOURCE).parent)
    for path in _git("ls-tree", "--name-only", f"{rev}:{csrc}").split():
        if path.endswith(".h"):
            (dest / path).write_text(_git("show", f"{rev}:{csrc}/{path}"))
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="the revision to compare against")
    ap.add_argument("--steps", default="64x128,64x512,32x512,8x512",
                    help="decode steps, SEQUENCESxCONTEXT, comma-separated")
    ap.add_argument("--heads", default="9,3,64", help="query heads, kv heads, head dim")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=150)
    ap.add_argument("--layers", type=int, default=1,
                    help="caches per step, one per layer, run in turn by each timed call")
    ap.add_argument("--scatter", action="store_true",
                    help="the step's blocks in a random order in the pool, not consecutive")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto",
                    help="the working tree's cache: --dtype, or the same values in scaled fp8")
    args = ap.parse_args()
    base_text = _git("show", f"{args.baseline}:{SOURCE}")
    torch.set_num_threads(args.threads)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(prefix="attention-ab-") as tmpdir:
        tmp = Path(tmpdir)
        base_include = _headers_at(args.baseline, tmp / "baseline-headers")
        ops = {"baseline": build_revision(base_text, "pa_baseline", base_include,
                                          tmp).paged_attention,
               "working tree": build_revision((REPO / SOURCE).read_text(), "pa_working",
                                              (REPO / SOURCE).parent, tmp).paged_attention}
        print(f"baseline {args.baseline}, {args.dtype}, working tree's KV cache "
              f"{args.kv_cache_dtype}, heads {hq}/{hkv}x{d}, threads "
              f"{args.threads}, {args.layers} layer(s) a call, blocks "
              f"{'scattered' if args.scatter else 'consecutive'}, median of {args.reps} "
              "alternated calls, per layer\n")
        print("| step | baseline (us) | working tree (us) | baseline / working tree "
              "| max output difference |")
        print("|---|---|---|---|---|")
        for step in args.steps.split(","):
            s, ctx = (int(x) for x in step.split("x"))
            bs = 16
            per = -(-(ctx + 1) // bs)
            g = torch.Generator().manual_seed(s * 1000 + ctx)
            caches = [torch.randn(s * per + 1, 2, bs, hkv, d, generator=g).to(dtype)
                      for _ in range(args.layers)]
            kv_scale = 1.0
            work_caches = caches
            if args.kv_cache_dtype == "fp8_e4m3":
                kv_scale = scale_from_amax(max(float(c.abs().max()) for c in caches))
                work_caches = [quantize_kv(c, FP8_E4M3, kv_scale) for c in caches]
            order = torch.randperm(s * per, generator=g) if args.scatter else torch.arange(s * per)
            table = order.to(torch.int32).view(s, per).contiguous() + 1  # block 0: the null block
            q = torch.randn(s, hq, d, generator=g).to(dtype)
            cu = torch.arange(s + 1, dtype=torch.int32)
            lens = torch.full((s,), ctx + 1, dtype=torch.int32)
            outs = {k: torch.empty_like(q) for k in ops}
            calls = [functools.partial(run_layers, op, q,
                                       caches if k == "baseline" else work_caches, outs[k],
                                       *meta_args(op, cu, lens, table, d**-0.5,
                                                  1.0 if k == "baseline" else kv_scale))
                     for k, op in ops.items()]
            t_base, t_new = (t / args.layers for t in time_alternating(calls, args.reps))
            diff = (outs["baseline"].float() - outs["working tree"].float()).abs().max().item()
            print(f"| decode {s} x {ctx} | {t_base * 1e6:.0f} | {t_new * 1e6:.0f} | "
                  f"{t_base / t_new:.2f}x | {diff:.2g} |")


if __name__ == "__main__":
    main()
