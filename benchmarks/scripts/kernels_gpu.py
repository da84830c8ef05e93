"""GPU check of the paged-attention kernels: parity on CUDA, then decode bandwidth.

1. Parity: every Triton kernel against its torch reference on the same device, in float32,
   bfloat16 and float16 (mixed prefill/continuation/decode batches, GQA, sliding window,
   split-KV, decode context parallelism merged with ``merge_attn_states``).
   Tolerances (max abs error / max abs reference): float32 1e-5, bfloat16 2e-2, float16 5e-3
   (LSE: 1e-5 / 1e-4); the reference computes in float32 from the same rounded inputs. Copies
   must be exact.
2. Decode timing with CUDA events: batch 64, contexts 4k and 16k, GQA 8:1, head dim 128,
   block size 16, bfloat16. Reports the achieved KV-read bandwidth against a device-to-device
   copy measured in the same run, and the time against
   ``torch.nn.functional.scaled_dot_product_attention`` on the same KV laid out contiguously.
   Targets: >= 70% of copy bandwidth at 16k; paged <= 1.2x contiguous SDPA.

Writes a markdown report to stdout (and to ``--out``). Exit status 1 if a parity check fails
(also if a target is missed, with ``--strict``). Runs in well under 5 minutes on one GPU.

    python benchmarks/scripts/kernels_gpu.py --out kernels_gpu.md
    TRITON_INTERPRET=1 python benchmarks/scripts/kernels_gpu.py --device cpu --quick   # smoke test
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="also write the markdown report to this path")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke test")
    p.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--contexts", default="4096,16384", help="comma-separated context lengths")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--splits", default="auto,1,2,4,8",
                   help="num_kv_splits values to time; 'auto' lets the launcher choose")
    p.add_argument("--skip-parity", action="store_true")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    return p.parse_args(argv)


def rel_err(got, want) -> float:
    got, want = got.double(), want.double()
    if not bool(got.isfinite().all()):
        return math.inf
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def make_batch(torch, kernels, device, dtype, q_lens, seq_lens, block_size, h_kv, group, d,
               *, cp_size=1, interleave=1, seed=0):
    """Random batch; KV written through the CP slot formula into scattered, shuffled blocks."""
    g = torch.Generator().manual_seed(seed)  # data: same tokens whatever the layout
    lay = torch.Generator().manual_seed(seed + 7919)  # layout: block ids, cache filler
    keys = [torch.randn(n, h_kv, d, generator=g).to(dtype) for n in seq_lens]
    values = [torch.randn(n, h_kv, d, generator=g).to(dtype) for n in seq_lens]
    vb = block_size * cp_size
    nvb = [math.ceil(n / vb) for n in seq_lens]
    num_blocks = sum(nvb) + 2
    perm = torch.randperm(num_blocks, generator=lay)
    table = torch.full((len(seq_lens), max(nvb) + 1), 1 << 20, dtype=torch.int32)
    used = 0
    for s, n in enumerate(nvb):
        table[s, :n] = perm[used:used + n].to(torch.int32)
        used += n
    caches = [torch.randn(num_blocks, 2, block_size, h_kv, d, generator=lay).to(dtype)
              for _ in range(cp_size)]
    for s, n in enumerate(seq_lens):
        pos = torch.arange(n)
        owner, local = kernels.cp_owner_and_offset(pos, block_size, cp_size, interleave)
        slot = table[s, pos // vb].long() * block_size + local
        for r in range(cp_size):
            kernels.reshape_and_cache_ref(keys[s], values[s], caches[r],
                                          torch.where(owner == r, slot, -1))
    q = torch.randn(sum(q_lens), h_kv * group, d, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    to = dict(device=device)
    return (q.to(**to), [c.to(**to) for c in caches], cu.to(**to),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), table.to(**to),
            1.0 / math.sqrt(d))


def parity(torch, kernels, device: str, quick: bool) -> list[tuple[str, str, float, float]]:
    rows: list[tuple[str, str, float, float]] = []
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if device == "cpu":
        dtypes = {"float32": torch.float32}  # the interpreter lacks bf16/fp16 dot
    cases = [(16, 8, 2, 128, None, None), (32, 4, 2, 64, 40, None), (8, 1, 2, 128, 5, None),
             (16, 8, 1, 128, None, 4)]
    if quick:
        cases = cases[:1] + cases[-1:]
    for name, dt in dtypes.items():
        for bs, group, h_kv, d, window, splits in cases:
            q_lens = [37, 21, 4, 1, 1, 1, 1]
            seq_lens = [37, 21 + 5 * bs + 3, 50, 8 * bs, 1, 300 if quick else 2000, 9]
            q, caches, cu, lens, table, scale = make_batch(
                torch, kernels, device, dt, q_lens, seq_lens, bs, h_kv, group, d, seed=bs + d)
            res = []
            for fn in (kernels.triton_paged_attention, kernels.paged_attention_ref):
                out = torch.full_like(q, math.nan)
                lse = fn(q, caches[0], out, cu, lens, table, scale, sliding_window=window,
                         return_lse=True, num_kv_splits=splits)
                res.append((out, lse))
            label = f"paged_attention B={bs} G={group} D={d} win={window} splits={splits}"
            rows.append((label, name, rel_err(res[0][0], res[1][0]), TOL[name]))
            # Scores are exact products accumulated in float32 on both sides: the LSE stays tight.
            lse_tol = 1e-5 if name == "float32" else 1e-4
            rows.append((label + " (lse)", name, rel_err(res[0][1], res[1][1]), lse_tol))
        for w, inter in ((4, 1), (2, 16)):
            q_lens, seq_lens = [12, 5, 1, 1, 1], [12, 53, 1, 24, 777]
            args = (torch, kernels, device, dt, q_lens, seq_lens, 16, 1, 8, 128)
            q, caches, cu, lens, table, scale = make_batch(*args, cp_size=w, interleave=inter,
                                                           seed=w)
            outs, lses = [], []
            for r in range(w):
                out = torch.full_like(q, math.nan)
                lses.append(kernels.triton_paged_attention(
                    q, caches[r], out, cu, lens, table, scale,
                    cp=kernels.CPLayout(r, w, inter), return_lse=True))
                outs.append(out)
            merged, _ = kernels.triton_merge_attn_states(torch.stack(outs), torch.stack(lses))
            q1, c1, cu1, lens1, t1, _ = make_batch(*args, seed=w)  # same tokens, one rank
            want = torch.full_like(q, math.nan)
            kernels.paged_attention_ref(q1, c1[0], want, cu1, lens1, t1, scale)
            rows.append((f"dcp W={w} I={inter} (per-rank attention + merge vs one rank)", name,
                         rel_err(merged, want), TOL[name]))
        g = torch.Generator().manual_seed(1)
        outs = torch.randn(3, 40, 8, 128, generator=g).to(dt).to(device)
        lses = (torch.randn(3, 40, 8, generator=g) * 3).to(device)
        lses[0, :5] = -math.inf
        lses[1, 5:9] = math.nan
        got, want = (kernels.triton_merge_attn_states(outs, lses),
                     kernels.merge_attn_states_ref(outs, lses))
        rows.append(("merge_attn_states", name, rel_err(got[0], want[0]), TOL[name]))
        cache = torch.randn(6, 2, 16, 2, 128, generator=g).to(dt).to(device)
        key = torch.randn(30, 2, 128, generator=g).to(dt).to(device)
        val = torch.randn(30, 2, 128, generator=g).to(dt).to(device)
        slots = torch.randperm(96, generator=g)[:30].to(device)
        slots[::4] = -1
        c1, c2 = cache.clone(), cache.clone()
        kernels.triton_reshape_and_cache(key, val, c1, slots)
        kernels.reshape_and_cache_ref(key, val, c2, slots)
        rows.append(("reshape_and_cache (exact)", name, 0.0 if torch.equal(c1, c2) else 1.0, 0.0))
        pairs = torch.tensor([[0, 5], [2, 3], [0, 4]], device=device)
        kernels.triton_copy_blocks([c1], pairs)
        kernels.copy_blocks_ref([c2], pairs)
        rows.append(("copy_blocks (exact)", name, 0.0 if torch.equal(c1, c2) else 1.0, 0.0))
    return rows


def timer(torch, device: str) -> Callable[[Callable[[], object], int], float]:
    def cuda_ms(fn: Callable[[], object], iters: int) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def cpu_ms(fn: Callable[[], object], iters: int) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters

    return cuda_ms if device == "cuda" else cpu_ms


def bench_context(torch, kernels, args, ctx: int, b: int, iters: int):
    """Times one context length; returns (table rows, (copy fraction, paged/SDPA) for auto)."""
    f = torch.nn.functional
    dev, dt = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    ms = timer(torch, dev)
    hq, hkv, d, bs = args.q_heads, args.kv_heads, args.head_dim, args.block_size
    nblk = ctx // bs
    gen = torch.Generator(device=dev).manual_seed(ctx)
    k = torch.randn(b, hkv, ctx, d, device=dev, dtype=dt, generator=gen)  # [b, H_kv, ctx, D]
    v = torch.randn(b, hkv, ctx, d, device=dev, dtype=dt, generator=gen)
    q = torch.randn(b, hq, d, device=dev, dtype=dt, generator=gen)
    table = torch.randperm(b * nblk, device=dev).to(torch.int32).view(b, nblk)  # scattered ids
    cache = torch.empty(b * nblk, 2, bs, hkv, d, device=dev, dtype=dt)
    flat = table.long().flatten()
    cache[flat, 0] = k.view(b, hkv, nblk, bs, d).permute(0, 2, 3, 1, 4).reshape(-1, bs, hkv, d)
    cache[flat, 1] = v.view(b, hkv, nblk, bs, d).permute(0, 2, 3, 1, 4).reshape(-1, bs, hkv, d)
    cu = torch.arange(b + 1, device=dev, dtype=torch.int32)
    lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(d)
    kv_bytes = 2 * k.numel() * k.element_size()

    # Device-to-device copy of the same number of bytes (read + write).
    src = torch.empty(kv_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_gbs = 2 * kv_bytes / (ms(lambda: dst.copy_(src), iters) * 1e-3) / 1e9
    src = dst = None

    # SDPA on contiguous KV; the query heads of a group become the query rows (decode sees every
    # key, so this is exact and reads each KV head once, like the paged kernel).
    qc = q.view(b, hkv, hq // hkv, d)
    sdpa_ms = ms(lambda: f.scaled_dot_product_attention(qc, k, v, scale=scale), iters)
    want = f.scaled_dot_product_attention(qc, k, v, scale=scale).reshape(b, hq, d)

    rows, auto = [], None
    for s in args.splits.split(","):
        splits = None if s == "auto" else int(s)

        def run(splits=splits):
            kernels.triton_paged_attention(q, cache, out, cu, lens, table, scale,
                                           num_kv_splits=splits)

        run()
        err = rel_err(out, want)
        if err > TOL["bfloat16"]:
            rows.append(f"| {ctx} | {s} | FAILED parity vs SDPA: rel err {err:.2e} | | | | |")
            auto = auto or (0.0, math.inf)
            continue
        t = ms(run, iters)
        gbs = kv_bytes / (t * 1e-3) / 1e9
        rows.append(f"| {ctx} | {s} | {t:.3f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% | "
                    f"{sdpa_ms:.3f} | {t / sdpa_ms:.2f} |")
        if s == "auto":
            auto = (gbs / copy_gbs, t / sdpa_ms)
    rows.append(f"| {ctx} | d2d copy | | {copy_gbs:.0f} (r+w) | 100% | | |")
    return rows, auto


def decode_bench(torch, kernels, args: argparse.Namespace) -> tuple[list[str], bool]:
    contexts = [int(c) for c in args.contexts.split(",")]
    b, iters = args.batch, args.iters
    if args.quick:
        b, contexts, iters = 2, [64], 2
    lines = ["| context | splits | paged ms | KV GB/s | % of copy BW | SDPA ms | paged/SDPA |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    summary = []
    for ctx in contexts:
        rows, auto = bench_context(torch, kernels, args, ctx, b, iters)
        lines += rows
        if auto is not None:
            summary.append((ctx, *auto))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    lines.append("")
    ok = True
    for ctx, frac, ratio in summary:
        verdict = []
        if ctx == max(contexts):
            verdict.append(f"target >= 70%: {'met' if frac >= 0.7 else 'MISSED'}")
            ok = ok and frac >= 0.7
        verdict.append(f"paged/SDPA {ratio:.2f}, target <= 1.2: "
                       f"{'met' if ratio <= 1.2 else 'MISSED'}")
        ok = ok and ratio <= 1.2
        lines.append(f"- context {ctx} (auto splits): {100 * frac:.0f}% of copy bandwidth; "
                     + "; ".join(verdict))
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from pagedserve import kernels

    if args.device == "cuda" and not torch.cuda.is_available():
        print("kernels_gpu.py: CUDA is not available (use --device cpu --quick for a smoke test)",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    report = ["# pagedserve kernels", ""]
    if args.device == "cuda":
        report.append(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
        report.append("")
    parity_ok = True
    if not args.skip_parity:
        report += ["## Parity (Triton vs torch reference, same device)", "",
                   "| check | dtype | rel err | tol | ok |", "|---|---|---:|---:|---|"]
        for label, dt, err, tol in parity(torch, kernels, args.device, args.quick):
            good = err <= tol
            parity_ok &= good
            mark = "ok" if good else "FAIL"
            report.append(f"| {label} | {dt} | {err:.2e} | {tol:.0e} | {mark} |")
        report.append("")
    report += [f"## Decode: batch {args.batch}, GQA {args.q_heads}:{args.kv_heads}, "
               f"head dim {args.head_dim}, block {args.block_size}", ""]
    lines, targets_ok = decode_bench(torch, kernels, args)
    report += lines
    report += ["", f"total {time.perf_counter() - t0:.1f} s"]
    text = "\n".join(report)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    if not parity_ok:
        return 1
    return 1 if args.strict and not targets_ok else 0


if __name__ == "__main__":
    sys.exit(main())
