"""The CPU kernels against the torch code they replace, side by side in one process.

For each checkpoint shape (the peers benchmark's three: ``demo``, ``llama-22m``, ``smollm2``) and
each op of a decoder layer that has its own CPU path (the compiled kernels; the residual add fused
into the norm after it, against the add as its own op; the linear layers' packed matmul, tiled
where that kernel is built and oneDNN's elsewhere, against ``F.linear``; the sampler's argmax
over float32 logits, one row a sequence, against ``torch.argmax``): a decode step of 64
sequences (context 50-400 tokens), the same for 8 sequences (the end of a batch, when few requests
are left) and a prefill of 8 sequences of 200 tokens, float32 (or ``--dtype bfloat16``:
activations, weights and the cache in bf16, the rotary tables float32 as the model keeps them),
block size 16. The two implementations alternate call by call so that drift hits both; each figure
is the median of ``--reps`` timed calls after a warm-up. Paged attention's torch path is given its
plan built once (as the engine does per step), so the comparison is the per-layer cost; "as the
engine calls it" is the dispatcher with the step's plan cache, which leaves sequences with more
than 16 new tokens to the torch path.

    python benchmarks/scripts/cpu_kernels.py
    python benchmarks/scripts/cpu_kernels.py --out docs/results/cpu_kernels.md
    python benchmarks/scripts/cpu_kernels.py --dtype bfloat16 --models llama-22m --reps 10
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedserve.benchmarks.report import emit_table
from pagedserve.kernels import (
    cpu_paged_attention,
    paged_attention,
    paged_attention_ref,
    plan_paged_attention,
    reshape_and_cache,
    reshape_and_cache_ref,
)
from pagedserve.kernels import layer_ops as ops
from pagedserve.kernels.argmax import argmax, argmax_ref
from pagedserve.kernels.cpu import cpu_ops
from pagedserve.kernels.linear import linear, linear_ref, pack_weight

# name: (hidden, q heads, kv heads, head dim, intermediate, vocab)
SHAPES = {
    "demo": (256, 4, 2, 64, 512, 2048),
    "llama-22m": (512, 8, 4, 64, 1024, 2048),
    "smollm2": (576, 9, 3, 64, 1536, 49152),
}
STEPS = ("decode", "decode, 8 sequences", "prefill")
BLOCK = 16


def _paged_batch(lens: list[int], q_lens: list[int], hq: int, hkv: int, d: int, g):
    nb = sum(-(-n // BLOCK) for n in lens) + 1
    cache = torch.randn(nb, 2, BLOCK, hkv, d, generator=g)
    perm = torch.randperm(nb, generator=g)
    table = torch.zeros(len(lens), max(-(-n // BLOCK) for n in lens), dtype=torch.int32)
    used = 0
    for s, n in enumerate(lens):
        k = -(-n // BLOCK)
        table[s, :k] = perm[used: used + k].to(torch.int32)
        used += k
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    return q, cache, cu, torch.tensor(lens, dtype=torch.int32), table


def cases(
    name: str, step: str, dtype: torch.dtype = torch.float32
) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """op -> (compiled, torch) zero-argument calls on one layer's inputs in ``dtype``."""
    hidden, hq, hkv, d, inter, vocab = SHAPES[name]
    g = torch.Generator().manual_seed(0)
    if step.startswith("decode"):
        n = 8 if "8" in step else 64
        lens = torch.randint(50, 401, (n,), generator=g).tolist()
        q_lens = [1] * n
    else:
        lens, q_lens = [200] * 8, [200] * 8
    t = sum(q_lens)
    q, cache, cu, seq_lens, table = _paged_batch(lens, q_lens, hq, hkv, d, g)
    q, cache = q.to(dtype), cache.to(dtype)
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(d)
    plan = plan_paged_attention(cu, seq_lens, table, block_size=BLOCK, num_kv_heads=hkv,
                                num_q_heads=hq, head_dim=d)
    x = torch.randn(t, hidden, generator=g).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    residual = torch.randn(t, hidden, generator=g).to(dtype)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    qv = qkv[:, : hq * d].view(t, hq, d)
    kv = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    vv = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    pos = torch.cat([torch.arange(n - k, n) for n, k in zip(lens, q_lens, strict=True)])
    ang = torch.randn(2048, d // 2, generator=g)
    cos, sin = ang.cos(), ang.sin()
    gate_up = torch.randn(t, 2 * inter, generator=g).to(dtype)
    slots = torch.randperm(cache.shape[0] * BLOCK, generator=g)[:t]
    plans: dict = {}  # the engine's per-step plan cache, shared by the layers
    attn_out = torch.randn(t, hq * d, generator=g).to(dtype)
    logits = torch.randn(len(lens), vocab, generator=g)
    linears = {  # op -> (input rows, weight [out, in]); the lm head sees one row per sequence
        "linear: qkv": (x, torch.randn((hq + 2 * hkv) * d, hidden, generator=g)),
        "linear: o": (attn_out, torch.randn(hidden, hq * d, generator=g)),
        "linear: gate and up": (x, torch.randn(2 * inter, hidden, generator=g)),
        "linear: down": (gate_up[:, :inter].contiguous(), torch.randn(hidden, inter, generator=g)),
        "linear: lm head": (x[: len(lens)].contiguous(), torch.randn(vocab, hidden, generator=g)),
    }
    return {
        **{op: _linear_pair(rows, weight.to(dtype)) for op, (rows, weight) in linears.items()},
        "paged attention (kernel)": (
            lambda: cpu_paged_attention(q, cache, out, cu, seq_lens, table, scale, None, False),
            lambda: paged_attention_ref(q, cache, out, cu, seq_lens, table, scale, plan=plan)),
        "paged attention (as the engine calls it)": (
            lambda: paged_attention(q, cache, out, cu, seq_lens, table, scale, plans=plans),
            lambda: paged_attention_ref(q, cache, out, cu, seq_lens, table, scale, plan=plan)),
        "RMSNorm": (lambda: ops.rms_norm(x, w, 1e-5), lambda: ops.rms_norm_ref(x, w, 1e-5)),
        # against what the layer did before: the add as its own op, then the compiled norm
        "residual add + RMSNorm": (lambda: ops.add_rms_norm_(residual, x, w, 1e-5),
                                   lambda: ops.rms_norm(residual + x, w, 1e-5)),
        "rotary (q and k)": (lambda: ops.rotary(qv, kv, pos, cos, sin),
                             lambda: ops.rotary_ref(qv, kv, pos, cos, sin)),
        "SiLU and mul": (lambda: ops.silu_and_mul(gate_up),
                         lambda: ops.silu_and_mul_ref(gate_up)),
        "cache write": (lambda: reshape_and_cache(kv, vv, cache, slots),
                        lambda: reshape_and_cache_ref(kv, vv, cache, slots)),
        # the sampler's greedy pick over float32 logits, one row per sequence
        "argmax over the logits": (lambda: argmax(logits), lambda: argmax_ref(logits)),
    }


def _linear_pair(rows: torch.Tensor, weight: torch.Tensor):
    # Packed whatever its size, to show where packing pays; where the dtype is not packed here
    # (bf16 without bf16 instructions) both sides are F.linear.
    packed = pack_weight(weight)
    return (lambda: linear(rows, weight if packed is None else None, packed),
            lambda: linear_ref(rows, weight, None))


def build_revision(text: str, name: str, include_dir: Path, tmp: Path) -> object:
    """One kernel source ``text`` (a file of ``kernels/csrc`` at some revision) built as
    extension ``name`` with the library's flags and ``include_dir``'s headers, its ops
    registered under namespace ``name`` so that two revisions load side by side; returns
    ``torch.ops.<name>``."""
    import re

    from torch.utils.cpp_extension import load

    from pagedserve.kernels.cpu import _FLAGS

    src = tmp / f"{name}.cpp"
    src.write_text(re.sub(r"TORCH_LIBRARY(_FRAGMENT)?\(pagedserve_cpu",
                          f"TORCH_LIBRARY({name}", text))
    load(name=f"{name}_ext", sources=[str(src)], extra_include_paths=[str(include_dir)],
         extra_cflags=list(_FLAGS), extra_ldflags=["-fopenmp"], is_python_module=False,
         build_directory=str(tmp), verbose=False)
    return getattr(torch.ops, name)


def time_alternating(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """Each call's median time over ``reps`` rounds, the calls alternating within a round so
    that drift hits all of them; three untimed rounds first."""
    for _ in range(3):
        for f in fns:
            f()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for f, acc in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            f()
            acc.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if cpu_ops() is None:
        raise SystemExit("the compiled CPU kernels did not build (see the warning above)")
    lines = [f"{args.dtype}, {torch.get_num_threads()} torch threads, block size {BLOCK}, "
             f"median of {args.reps} calls each, alternating", "",
             "| shape | step | op | pagedserve (us) | torch (us) | torch / pagedserve |",
             "|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        for step in STEPS:
            for op, (a, b) in cases(name, step, dtype).items():
                ta, tb = time_alternating([a, b], args.reps)
                lines.append(f"| {name} | {step} | {op} | {ta * 1e6:.0f} | {tb * 1e6:.0f} | "
                             f"{tb / ta:.2f}x |")
                print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    emit_table(table, args.out)


if __name__ == "__main__":
    main()
