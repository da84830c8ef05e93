"""One forward pass of the model, the compiled whole-layer call against the modules: per batch
shape, the median time of a step with every layer taking ``kernels.decoder_layer`` and of the
same step through the Python modules, alternated call by call in one process (so the machine's
drift cancels), and their ratio. Nothing but the model's forward is timed: no scheduler, no
sampling, no HTTP.

Shapes: ``decode N`` is N sequences of one new token each after ``--context`` cached tokens;
``prefill T`` one sequence of T new tokens from an empty cache; ``verify K`` one sequence of K
new tokens after ``--context`` cached tokens (a speculative step: its last token and drafts).

    python benchmarks/scripts/layer_step.py --model smollm2 --dtype bfloat16
    python benchmarks/scripts/layer_step.py --model llama-22m --dtype float32 --out FILE.md
    python benchmarks/scripts/layer_step.py --profile   # also: each shape's operators, by time
    python benchmarks/scripts/layer_step.py --quantization int8
    python benchmarks/scripts/layer_step.py --kv-cache-dtype fp8_e4m3   # the cache's own dtype

``--profile`` adds, per shape, torch.profiler's self time per operator over five forward passes
through the compiled layers (the matmuls, paged attention and the pointwise kernels each show
under their own name, called from the layer's C++).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from pagedserve.benchmarks.report import emit_table
from pagedserve.kernels.cpu import cpu_ops
from pagedserve.kernels.kv_quant import needs_scale, quantize_kv, scale_from_amax
from pagedserve.parallel.state import ParallelState
from pagedserve.workers.context import AttentionMetadata, ForwardContext, forward_context
from pagedserve.workers.kv_dtype import resolve_kv_cache_dtype
from pagedserve.workers.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import model_dir  # noqa: E402

BLOCK = 16


def step_inputs(kind: str, n: int, context: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """(input_ids, positions, slot_mapping, block_table, seq_lens, cu_seqlens_q) of one step;
    sequence s owns blocks [s * per, (s + 1) * per) (block 0 stays the null block)."""
    g = torch.Generator().manual_seed(n)
    if kind == "decode":
        lens, new = [context + 1] * n, [1] * n
    elif kind == "verify":
        lens, new = [context + n], [n]
    else:
        lens, new = [n], [n]
    per = -(-max(lens) // BLOCK)
    table = (torch.arange(len(lens) * per, dtype=torch.int32).view(len(lens), per) + 1)
    positions = torch.cat([torch.arange(ln - q, ln) for ln, q in zip(lens, new, strict=True)])
    seq_of = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(new))
    slots = table[seq_of, positions // BLOCK].long() * BLOCK + positions % BLOCK
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(new), 0)
    ids = torch.randint(3, vocab, (int(cu[-1]),), generator=g)
    return ids, positions, slots, table, torch.tensor(lens, dtype=torch.int32), cu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--context", type=int, default=128, help="cached tokens before a decode")
    ap.add_argument("--shapes", default="decode:1,decode:8,decode:64,prefill:128")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    ap.add_argument("--profile", action="store_true", help="each shape's operators, by time")
    ap.add_argument("--quantization", default="none", help="the engine's quantization option")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8_e4m3"])
    args = ap.parse_args()
    if cpu_ops() is None:
        sys.exit("the compiled CPU kernels did not build")
    torch.manual_seed(0)
    model, arch, dtype = load_model(model_dir(args.model), args.dtype, torch.device("cpu"),
                                    ParallelState(), quantization=args.quantization)
    layers = model.model
    fused = list(layers.fused)
    shapes = [(k, int(n)) for k, n in (s.split(":") for s in args.shapes.split(","))]
    most = max(n if k == "decode" else 1 for k, n in shapes)
    blocks = most * -(-(args.context + max(n for _, n in shapes)) // BLOCK) + 1
    d = arch.head_dim
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    for layer in layers.layers:
        attn = layer.self_attn.attn
        kv = torch.randn(blocks, 2, BLOCK, attn.num_kv_heads, d)
        scale = scale_from_amax(float(kv.abs().max())) if needs_scale(kv_dtype) else 1.0
        attn.kv_cache = quantize_kv(kv.to(dtype), kv_dtype, scale)
        attn.k_scale = attn.v_scale = scale
    rows = [f"model `{args.model}`, {args.dtype}, quantization {args.quantization}, "
            f"KV cache {kv_dtype}, "
            f"{sum(w is not None for w in fused)} of {len(fused)} layers qualify, torch threads "
            f"{torch.get_num_threads()}, context {args.context}; median of {args.reps} "
            "alternated calls", "",
            "| step | modules (ms) | compiled layer (ms) | modules / compiled |",
            "|---|---|---|---|"]
    with torch.inference_mode():
        for kind, n in shapes:
            ids, pos, slots, table, lens, cu = step_inputs(kind, n, args.context, arch.vocab_size)
            ctx = ForwardContext([AttentionMetadata(slots, table, lens, cu)])
            times: dict[bool, list[float]] = {False: [], True: []}
            for i in range(2 * args.reps + 4):
                on = i % 2 == 0
                layers.fused = fused if on else [None] * len(fused)
                ctx.groups[0].plans.clear()  # the modules' plans are per step
                start = time.perf_counter()
                with forward_context(ctx):
                    model(ids, pos)
                if i >= 4:  # the first calls warm each path
                    times[on].append(time.perf_counter() - start)
            off, on_ = statistics.median(times[False]), statistics.median(times[True])
            rows.append(f"| {kind} {n} | {off * 1e3:.2f} | {on_ * 1e3:.2f} | {off / on_:.2f}x |")
            print(rows[-1], flush=True)
            if args.profile:
                layers.fused = fused
                with torch.profiler.profile() as prof:
                    for _ in range(5):
                        with forward_context(ctx):
                            model(ids, pos)
                print(f"{kind} {n}, compiled layers, self time per operator:")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    emit_table("\n".join(rows) + "\n", args.out)


if __name__ == "__main__":
    main()
