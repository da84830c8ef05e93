"""The compiled CPU kernels compile for x86 machines other than this one.

The library is built with ``-march=native``, so CI only ever compiles the branches of this
machine's instruction sets. AVX-512 hosts without AVX512-BF16 (Skylake-SP and Cascade Lake, and
Ice Lake, which has VNNI) take other ``#if`` branches; each has broken once (a name that only a
BF16 build declares), and there the whole library fails to build and every op falls back to
the torch reference. Checked here by compiling (syntax and template instantiation, no code
generation) each source with intrinsics for those targets.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

CSRC = Path(__file__).resolve().parents[2] / "kernels" / "csrc"
# The sources whose intrinsics depend on the target (decoder_layer_cpu.cpp has none).
SOURCES = ("paged_attention_cpu.cpp", "linear_cpu.cpp", "quant_cpu.cpp", "layers_cpu.cpp")
TARGETS = ("skylake-avx512", "icelake-server")  # AVX-512 F/BW, then + VNNI and VBMI; no BF16


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None,
                    reason="an x86 g++ is what builds the library here")
def test_sources_compile_for_avx512_without_bf16() -> None:
    incs = [f"-I{p}" for p in include_paths()]

    def compile_one(job: tuple[str, str]) -> str:
        march, src = job
        r = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-O2", f"-march={march}",
                            "-fopenmp", "-w", *incs, str(CSRC / src)],
                           capture_output=True, text=True, check=False)
        return "" if r.returncode == 0 else f"{src} at -march={march}:\n{r.stderr[-2000:]}"

    with ThreadPoolExecutor(max_workers=2) as pool:
        errors = [e for e in pool.map(compile_one, [(m, s) for m in TARGETS for s in SOURCES])
                  if e]
    assert not errors, "\n".join(errors)
