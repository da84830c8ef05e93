"""The compiled CPU kernels: paged attention that reads K/V through the block table in place
(``csrc/paged_attention_cpu.cpp``) and a layer's pointwise ops (``csrc/layers_cpu.cpp``, used
through ``kernels.layer_ops`` and ``kernels.reshape_and_cache``) and the activation
quantization around an int8 matmul (``csrc/quant_cpu.cpp``, through ``kernels.quant_linear``),
a whole decoder layer strung from those (``csrc/decoder_layer_cpu.cpp``,
``kernels.decoder_layer``), and the sampler's argmax over a step's logits
(``csrc/argmax_cpu.cpp``, ``kernels.argmax``).

The library is built on first use with the machine's C++ compiler
(``torch.utils.cpp_extension``, ninja from the ``ninja`` package) into
``$TORCH_EXTENSIONS_DIR/pagedserve-cpu-<key>`` (default ``~/.cache/torch_extensions``; not
``XDG_CACHE_HOME``, which deployments and tests point at per-model caches: each would rebuild),
the key covering the source, the flags, torch's version and the CPU's instruction sets (it is
built with ``-march=native``), so a home shared by machines of different CPUs never loads a
foreign build. The kernels take float32 and bfloat16 (``compiled_for``); bf16 is converted
to float32 by bit shifts in plain C++ (``csrc/bf16.h``), which ``-march=native`` vectorises for
whatever the machine has, AVX2 or AVX-512. Where no compiler works, :func:`cpu_ops` returns
None once, with a warning, and the dispatcher keeps the torch reference.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from pagedserve.kernels._checks import kv_dtype_pairs
from pagedserve.kernels.cpu_caps import cpu_flags_line
from pagedserve.kernels.errors import KernelArgumentError

log = logging.getLogger(__name__)

_SOURCES = tuple(Path(__file__).with_name("csrc") / name
                 for name in ("paged_attention_cpu.cpp", "layers_cpu.cpp", "quant_cpu.cpp",
                              "decoder_layer_cpu.cpp", "linear_cpu.cpp", "argmax_cpu.cpp",
                              "vec_exp.h", "bf16.h", "rows.h", "keys16.h", "linear_steps.h",
                              "quant_rows.h", "fp8.h"))
_LIB = "pagedserve_cpu"
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math")


def extensions_root() -> Path:
    """Where the builds live: ``TORCH_EXTENSIONS_DIR``, else torch's own default."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root)


def _build_dir() -> Path:
    key = hashlib.sha256()
    for part in (*(src.read_bytes() for src in _SOURCES), " ".join(_FLAGS).encode(),
                 torch.__version__.encode(), cpu_flags_line().encode()):
        key.update(part)
    return extensions_root() / f"pagedserve-cpu-{key.hexdigest()[:16]}"


def _build(target: Path) -> None:
    """Compile into a private folder, then rename it to ``target`` in one step: processes that
    build at once (the ranks of a group) each finish or lose the race harmlessly, and one killed
    mid-build leaves no lock behind for the others to wait on (torch's own build folder lock
    would)."""
    import ninja  # the build tool, as a Python package so that pip installs it
    from torch.utils.cpp_extension import load

    # torch looks for ninja on PATH; a venv's bin is not on it unless activated.
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{target.name}.build-", dir=target.parent))
    try:
        load(name=_LIB, sources=[str(s) for s in _SOURCES if s.suffix == ".cpp"],
             extra_cflags=list(_FLAGS), extra_ldflags=["-fopenmp"], build_directory=str(tmp),
             is_python_module=False, verbose=False)
        os.rename(tmp, target)
    except OSError:
        if not (target / f"{_LIB}.so").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the loaded library stays mapped


@functools.cache
def cpu_ops() -> Any:
    """``torch.ops.pagedserve_cpu`` once the library is built and loaded, else None."""
    try:
        target = _build_dir()
        if not hasattr(torch.ops.pagedserve_cpu, "paged_attention"):
            if (target / f"{_LIB}.so").exists():
                torch.ops.load_library(str(target / f"{_LIB}.so"))
            else:
                _build(target)
        return torch.ops.pagedserve_cpu
    except Exception as exc:  # no compiler, no headers, a failed build: keep the torch path
        log.warning("pagedserve: the compiled CPU kernels are unavailable (%s: %s); using the "
                    "torch references", type(exc).__name__, exc)
        return None


COMPILED_DTYPES = (torch.float32, torch.bfloat16)


def compiled_for(*tensors: torch.Tensor) -> bool:
    """Whether the compiled kernels serve these tensors: all on the CPU in one of
    ``COMPILED_DTYPES`` (each op's dispatcher says which may differ), library built."""
    return (all(t.device.type == "cpu" and t.dtype in COMPILED_DTYPES for t in tensors)
            and cpu_ops() is not None)


def compiled_cache(dtype: torch.dtype, kv_cache: torch.Tensor) -> bool:
    """Whether the compiled kernels (the cache write, attention, the whole layer) take this KV
    cache under activations of ``dtype``: on the CPU, any pairing the kernels accept
    (``_checks.kv_dtype_pairs``: that dtype or a KV storage dtype, read with its scales)."""
    return kv_cache.device.type == "cpu" and kv_dtype_pairs(dtype, kv_cache)


def cpu_paged_attention(
    q: torch.Tensor,  # [T_q, H_q, D] float32 or bfloat16, unit stride in D
    kv_cache: torch.Tensor,  # [num_blocks, 2, B, H_kv, D] q's dtype, bf16 or fp8, contiguous
    out: torch.Tensor,  # [T_q, H_q, D] q's dtype, unit stride in D; written
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int32
    softmax_scale: float,
    sliding_window: int | None,
    return_lse: bool,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor | None:
    """``paged_attention_ref``'s semantics without context parallelism, through the compiled
    kernel (the caller has checked :func:`cpu_ops`). Returns the LSE ``[T_q, H_q]`` if asked."""
    ops = cpu_ops()
    lse = (torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float32)
           if return_lse else torch.empty(0, dtype=torch.float32))
    bad = ops.paged_attention(q, kv_cache, out, cu_seqlens_q, seq_lens,
                              block_table.contiguous(), float(softmax_scale),
                              -1 if sliding_window is None else int(sliding_window),
                              float(k_scale), float(v_scale), lse)
    if bad >= 0:
        q_len = int(cu_seqlens_q[bad + 1] - cu_seqlens_q[bad])
        raise KernelArgumentError(
            f"sequence {bad} (new tokens {q_len}, length {int(seq_lens[bad])}) does not fit its "
            f"block-table row of {block_table.shape[1]} blocks of {kv_cache.shape[2]} in a pool "
            f"of {kv_cache.shape[0]} blocks")
    return lse if return_lse else None
