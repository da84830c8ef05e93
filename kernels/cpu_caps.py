"""What this CPU computes fast, read once at run time: the engine and its tests run on machines
with and without bfloat16 instructions (an AVX2-only host emulates bf16 matmuls at a fraction of
its float32 speed; AVX512-BF16 and AMX run them at up to twice it), so the choices that depend
on it (``dtype="auto"``, the bf16 weight packing) ask here instead of assuming either.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch

# x86 (/proc/cpuinfo "flags"): AVX512-BF16's dot products, AMX's bf16 tiles. Arm ("Features"):
# the BF16 extension (BFDOT/BFMMLA).
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags_line() -> str:
    """The CPU's flags as the kernel reports them (the build key of the compiled kernels), or
    the processor name where there is no /proc/cpuinfo."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.cache
def cpu_flags() -> frozenset[str]:
    _, _, flags = cpu_flags_line().partition(":")
    return frozenset(flags.split())


def native_bf16_flags() -> tuple[str, ...]:
    """The bf16 instruction sets this CPU has (empty: bf16 arithmetic is emulated)."""
    flags = cpu_flags()
    return tuple(f for f in BF16_FLAGS if f in flags)


def has_native_bf16() -> bool:
    """Whether bf16 matmuls run in hardware here, so a bf16 model beats its float32 twin."""
    return bool(native_bf16_flags())


def describe() -> str:
    """One phrase for the log: torch's vector ISA and the bf16 instructions found."""
    bf16 = ", ".join(native_bf16_flags()) or "no bf16 instructions"
    return f"{torch.backends.cpu.get_cpu_capability()} CPU, {bf16}"
