"""The tiled matmul (``kernels/csrc/linear_cpu.cpp``) against its own source at another
revision, in one process, streaming a whole model's weights.

Each revision is built as its own extension (``cpu_kernels.build_revision``). The weights are
SmolLM2's 120 layer projections (30 layers of qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536), or with ``--head`` four copies of its LM head (49152x576), tiled (``--dtype int8``:
quantized per output channel as ``quantization="int8"`` does, the rows given as codes to
``int8_linear_codes``, as the engine's fused norm and SiLU ops hand them over), laid end to end in
one buffer in 2 MiB pages (``--pages 2m``, collapsed once written, as the engine's weights
are: ``workers/huge_pages.py``) or 4 KiB pages (``--pages 4k``). One pass
multiplies ``--rows`` rows by every weight once, as a decode step does; the revisions take
passes in turns (``cpu_kernels.time_alternating``). Prints each revision's median pass, the
bandwidth it implies, their ratio and the largest difference between their outputs.

    python benchmarks/scripts/linear_ab.py --baseline HEAD~1
    python benchmarks/scripts/linear_ab.py --baseline HEAD~1 --pages 4k --head
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import torch
from cpu_kernels import build_revision, time_alternating

from pagedserve.kernels.cpu import cpu_ops
from pagedserve.kernels.linear import tile_weight
from pagedserve.kernels.quant_linear import quantize_int8
from pagedserve.workers import huge_pages

REPO = Path(__file__).resolve().parents[2]
SOURCE = "kernels/csrc/linear_cpu.cpp"
LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def weights(shapes: list[tuple[int, int]], dtype: torch.dtype,
            huge: bool) -> list[tuple[torch.Tensor, ...]]:
    """Tiled random weights, end to end in one buffer (2 MiB pages where ``huge``): each the
    tiled weight, and for int8 its code offsets and column scales after it."""
    store = torch.int8 if dtype == torch.int8 else dtype
    total = sum(n * k for n, k in shapes)
    pad = huge_pages.HUGE_PAGE // store.itemsize
    raw = torch.empty(total + pad, dtype=store)
    start = (-raw.data_ptr() % huge_pages.HUGE_PAGE) // store.itemsize
    arena = raw[start : start + total]
    out, at = [], 0
    g = torch.Generator().manual_seed(0)
    for n, k in shapes:
        w = torch.randn(n, k, generator=g)
        if dtype == torch.int8:
            q = quantize_int8(w)
            tiled, extra = q.tiled, (q.offset, q.col_scale)
        else:
            tiled, extra = tile_weight(w.to(dtype)), ()
        view = arena[at : at + n * k].view(tiled.shape)
        view.copy_(tiled)
        out.append((view, *extra))
        at += n * k
    if huge and huge_pages.collapse([arena]) == 0:
        raise SystemExit("the kernel refused 2 MiB pages here; run with --pages 4k")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="the revision to compare against")
    ap.add_argument("--pages", choices=("2m", "4k"), default="2m")
    ap.add_argument("--head", action="store_true", help="four LM heads, not the 120 layers")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "int8"), default="bfloat16")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--reps", type=int, default=60)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    shapes = [(49152, 576)] * 4 if args.head else [s for _ in range(30) for s in LAYER]
    ws = weights(shapes, dtype, args.pages == "2m")
    g = torch.Generator().manual_seed(1)
    act = torch.bfloat16 if dtype == torch.int8 else dtype
    xs = {k: torch.randn(args.rows, k, generator=g).to(act) for _, k in shapes}
    op_name = "int8_linear_codes" if dtype == torch.int8 else "linear_tiled"
    base_text = subprocess.run(["git", "show", f"{args.baseline}:{SOURCE}"], cwd=REPO,
                               check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory(prefix="linear-ab-") as tmpdir:
        tmp, include = Path(tmpdir), (REPO / SOURCE).parent
        ops = {"baseline": getattr(build_revision(base_text, "lin_baseline", include, tmp),
                                   op_name),
               "working tree": getattr(build_revision((REPO / SOURCE).read_text(), "lin_working",
                                                      include, tmp), op_name)}
        outs: dict[str, list[torch.Tensor]] = {k: [] for k in ops}
        if dtype == torch.int8:
            codes = {k: cpu_ops().quantize_rows_uint8(x, 0) for k, x in xs.items()}

        def call(name: str, w: tuple[torch.Tensor, ...], k: int) -> torch.Tensor:
            if dtype == torch.int8:
                return ops[name](*codes[k], w[0], w[1], w[2], None, act)
            return ops[name](xs[k], w[0], None)

        def one_pass(name: str) -> None:
            outs[name] = [call(name, w, k) for w, (_n, k) in zip(ws, shapes, strict=True)]

        t_base, t_new = time_alternating([lambda: one_pass("baseline"),
                                          lambda: one_pass("working tree")], args.reps)
    nbytes = sum(w[0].nbytes for w in ws)
    diff = max((a.float() - b.float()).abs().max().item()
               for a, b in zip(outs["baseline"], outs["working tree"], strict=True))
    what = "four LM heads 49152x576" if args.head else "SmolLM2's 120 layer projections"
    print(f"baseline {args.baseline}, {what} ({nbytes / 1e6:.0f} MB), {args.dtype}, "
          f"{args.rows} row(s), {args.pages} pages, torch threads {torch.get_num_threads()}, "
          f"median of {args.reps} alternated passes\n")
    print("| revision | pass (ms) | GB/s |")
    print("|---|---|---|")
    for name, t in (("baseline", t_base), ("working tree", t_new)):
        print(f"| {name} | {t * 1e3:.2f} | {nbytes / t / 1e9:.1f} |")
    print(f"\nbaseline / working tree: {t_base / t_new:.2f}x; largest output difference {diff:.2g}")


if __name__ == "__main__":
    main()
