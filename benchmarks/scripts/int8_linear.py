"""The int8 linear kernels against the bfloat16 one, per row count, on SmolLM2's layer shapes.

For each projection of a SmolLM2-135M decoder layer (qkv 960 x 576, o 576 x 576, gate and up
3072 x 576, down 576 x 1536) and each row count (a decode step of that many sequences, or that
many prefill tokens): oneDNN's bf16 matmul on its packed weight, the tiled bf16 kernel (what
``quantization="none"`` runs at bf16 where it is built), the weight-only int8 kernel
(``aten._weight_int8pack_mm``), the unfused dynamic int8 path (per-row activation quantization,
``torch._int_mm``, the scale epilogue) and ``int8_linear`` as the engine calls it for a
projection that may take dynamic activations (the tiled int8 kernel at every row count where it
is built; else weight-only up to ``WEIGHT_ONLY_ROWS`` rows, dynamic above; the down
projection's online Hadamard rotation is left out). The five alternate call by call
(``cpu_kernels.time_alternating``); each figure is the median of ``--reps`` timed calls after a
warm-up, in microseconds.

    python benchmarks/scripts/int8_linear.py
    python benchmarks/scripts/int8_linear.py --out docs/results/quantization.md
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
from cpu_kernels import time_alternating
from results_section import write_section

from pagedserve.kernels import quant_linear as ql
from pagedserve.kernels.linear import linear, pack_weight

# name: (out, in) of SmolLM2-135M's projections
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate and up": (3072, 576), "down": (576, 1536)}
ROWS = (1, 2, 3, 4, 8, 16, 64, 256)
KERNELS = ("bf16 (oneDNN, packed)", "bf16 (tiled)", "int8 weight-only",
           "int8 dynamic (unfused)", "int8_linear")


def _dynamic(x: torch.Tensor, codes: torch.Tensor, w: ql.Int8Weight) -> torch.Tensor:
    q, s = ql.quantize_rows_int8(x)
    return ql.dequantize_int32(torch._int_mm(q, codes.t()), s, w.col_scale, x.dtype)


def _calls(x: torch.Tensor, wb: torch.Tensor, w8: ql.Int8Weight) -> list[Callable[[], object]]:
    """The kernels of ``KERNELS`` on rows ``x``, in order (where this build lacks oneDNN's bf16
    matmul or the tiled kernel, its column runs what ``linear`` runs instead)."""
    try:  # oneDNN refuses a bf16 reorder on a CPU without bf16 instructions
        onednn = torch.ops.mkldnn._reorder_linear_weight(wb, None)
    except RuntimeError:
        onednn = None
    tiled = pack_weight(wb)
    codes = w8.qweight  # the plain codes, rebuilt once

    def bf16_onednn() -> object:
        if onednn is None:
            return linear(x, wb, None)
        return torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")

    return [bf16_onednn,
            lambda: linear(x, wb if tiled is None else None, tiled),
            lambda: torch.ops.aten._weight_int8pack_mm(x, codes, w8.scale),
            lambda: _dynamic(x, codes, w8),
            lambda: ql.int8_linear(x, w8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None,
                    help="write the table as its own section of this markdown file")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    lines = [f"bfloat16 activations, {torch.get_num_threads()} torch threads, CPU capability "
             f"{torch.backends.cpu.get_cpu_capability()}, median of {args.reps} calls each, "
             f"alternating; us per call (GFLOP/s)", "",
             "| projection | rows | " + " | ".join(KERNELS) + " | bf16 tiled / int8_linear |",
             "|---|---|" + "---|" * (len(KERNELS) + 1)]
    for name, (n, k) in SHAPES.items():
        wf = torch.randn(n, k, generator=g) / k ** 0.5
        wb = wf.bfloat16()
        w8 = ql.quantize_int8(wf)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=g).bfloat16()
            times = time_alternating(_calls(x, wb, w8), args.reps)
            flops = 2 * rows * n * k
            cells = [f"{t * 1e6:.0f} ({flops / t / 1e9:.0f})" for t in times]
            lines.append(f"| {name} | {rows} | " + " | ".join(cells)
                         + f" | {times[1] / times[4]:.2f}x |")
            print(lines[-1], flush=True)
    if args.out:
        body = ["## The int8 kernels per row count (SmolLM2's projections)", "",
                "Produced by:", "", "    python benchmarks/scripts/int8_linear.py --out "
                "docs/results/quantization.md", "", *lines]
        write_section(Path(args.out), "int8-kernels", body, "Weight quantization")


if __name__ == "__main__":
    main()
