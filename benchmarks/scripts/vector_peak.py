"""The machine's multiply-add peak per instruction kind, from a loop of nothing else.

Each kind runs twelve independent accumulator chains of one AVX-512 instruction (more than its
latency times its throughput, so only the throughput bounds the loop) for a fixed count, on
every core at once (one process per core), and prints instructions per nanosecond per core and
the operations a second over all cores: float32 FMA (``vfmadd``: 16 lanes x 2), bf16 pairs
(``vdpbf16ps``: 16 lanes x 2 products x 2) and int8 quads (``vpdpbusd``: 16 lanes x 4 x 2).
These are the ceilings the tiled matmul (``kernels/csrc/linear_cpu.cpp``) is held against in
``docs/results/performance.md``; the GEMM probe of ``peers.py`` is oneDNN's matmul, a kernel's
reach rather than the core's. Needs a compiler and a CPU with AVX512-BF16 and AVX512-VNNI.

    python benchmarks/scripts/vector_peak.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CHAINS 12
#define LOOP(TYPE, INIT, STEP, NAME, OPS)                                                 \
  {                                                                                       \
    TYPE acc[CHAINS];                                                                     \
    for (int i = 0; i < CHAINS; ++i) acc[i] = INIT;                                       \
    __m512i a = _mm512_set1_epi32(0x01010101), b = _mm512_set1_epi32(0x3f803f80);          \
    const double t0 = now();                                                              \
    for (long n = 0; n < iters; ++n) {                                                    \
      _Pragma("GCC unroll 12") for (int i = 0; i < CHAINS; ++i) acc[i] = STEP;            \
      __asm__ volatile("" : "+v"(a));                                                     \
    }                                                                                     \
    const double dt = now() - t0;                                                         \
    for (int i = 0; i < CHAINS; ++i) __asm__ volatile("" ::"v"(acc[i]));                   \
    printf("%s %.4f %d\n", NAME, iters * (double)CHAINS / dt / 1e9, OPS);                 \
  }

int main(int argc, char** argv) {
  const long iters = 50000000;
  LOOP(__m512, _mm512_setzero_ps(),
       _mm512_fmadd_ps(acc[i], _mm512_castsi512_ps(a), _mm512_castsi512_ps(b)),
       "float32-fma", 32)
  LOOP(__m512, _mm512_setzero_ps(),
       _mm512_dpbf16_ps(acc[i], (__m512bh)a, (__m512bh)b), "bf16-vdpbf16ps", 64)
  LOOP(__m512i, _mm512_setzero_si512(), _mm512_dpbusd_epi32(acc[i], a, b),
       "int8-vpdpbusd", 128)
  return 0;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="vector-peak-") as tmp:
        src, exe = Path(tmp) / "peak.c", Path(tmp) / "peak"
        src.write_text(SOURCE)
        subprocess.run(["cc", "-O2", "-march=native", str(src), "-o", str(exe)], check=True)
        procs = [subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True)
                 for _ in range(args.cores)]
        outs = [p.communicate()[0] for p in procs]
    rates: dict[str, list[float]] = {}
    ops: dict[str, int] = {}
    for out in outs:
        for line in out.splitlines():
            name, rate, per = line.split()
            rates.setdefault(name, []).append(float(rate))
            ops[name] = int(per)
    print(f"{args.cores} core(s) at once, twelve chains of one instruction each\n")
    print("| instruction | per core (per ns) | operations a second, all cores |")
    print("|---|---|---|")
    for name, per_core in rates.items():
        total = sum(per_core) * ops[name]
        print(f"| {name} | {min(per_core):.2f} | {total:.0f} G |")


if __name__ == "__main__":
    main()
