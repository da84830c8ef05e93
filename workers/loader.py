"""Load a Hugging Face checkpoint directory: ``config.json`` + ``*.safetensors``.

Handles a single ``model.safetensors``, a sharded checkpoint with
``model.safetensors.index.json``, or any set of ``*.safetensors`` files. Every failure is a
typed error: ``ModelLoadError`` (missing, unreadable, inconsistent) or
``UnsupportedModelError`` (an architecture or option this engine does not implement).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.kernels import cpu_caps
from pagedserve.parallel.linear import pack_weights
from pagedserve.parallel.state import ParallelState
from pagedserve.workers import huge_pages
from pagedserve.workers.errors import ModelLoadError, UnsupportedModelError
from pagedserve.workers.models.arch import ModelArch, read_arch
from pagedserve.workers.models.registry import model_class, supported_architectures
from pagedserve.workers.quantize import quantize_model, resolve_quantization

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "half": torch.float16,
}


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir)
    if not str(model_dir) or not path.is_dir():
        raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist")
    cfg_file = path / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} has no config.json") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {cfg_file}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_file} is not a JSON object")
    return cfg


def read_model_arch(cfg: dict[str, Any]) -> ModelArch:
    """The checkpoint's architecture, checked against the registry."""
    archs = cfg.get("architectures") or []
    supported = supported_architectures()
    arch_name = next((a for a in archs if model_class(a) is not None), None)
    if arch_name is None:
        raise UnsupportedModelError(", ".join(archs) or "<none>", supported)
    try:
        return read_arch(cfg, arch_name)
    except (KeyError, ValueError, TypeError) as exc:
        raise UnsupportedModelError(arch_name, supported, f"{arch_name}: {exc}") from exc


def read_eos_token_ids(model_dir: str | Path, cfg: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` (preferred) or ``config.json``."""
    eos: Any = None
    gen_file = Path(model_dir) / "generation_config.json"
    if gen_file.exists():
        try:
            eos = json.loads(gen_file.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            eos = None
    if eos is None:
        eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(int(i) for i in ids if isinstance(i, int))


def resolve_dtype(
    requested: str, checkpoint_dtype: str | None, device: torch.device
) -> torch.dtype:
    """``auto`` keeps the checkpoint dtype where the device computes it fast: on the CPU a bf16
    checkpoint stays bf16 only where the CPU has bf16 instructions (elsewhere bf16 matmuls are
    emulated, slower than float32), and float16 becomes float32. An explicit dtype is honoured
    everywhere: on an AVX2 CPU bf16's matmuls widen the weights to float32 as they read them
    (``kernels/csrc/linear_steps.h``), so a decode step streams half float32's bytes while a
    batch of many rows computes as float32 does."""
    if requested != "auto":
        return _DTYPES[requested]
    dtype = _DTYPES.get(str(checkpoint_dtype).removeprefix("torch."), torch.float32)
    if device.type != "cpu" or dtype not in (torch.float16, torch.bfloat16):
        return dtype
    if dtype == torch.bfloat16 and cpu_caps.has_native_bf16():
        log.info("pagedserve: dtype auto -> bfloat16, the checkpoint's (%s)", cpu_caps.describe())
        return dtype
    why = ("no bf16 instructions, bf16 would be emulated" if dtype == torch.bfloat16
           else "no fast float16 kernels on the CPU")
    log.info("pagedserve: dtype auto -> float32 for a %s checkpoint (%s: %s)",
             str(dtype).removeprefix("torch."), cpu_caps.describe(), why)
    return torch.float32


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot read {index}: {exc}") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights")
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise ModelLoadError(f"{model_dir} is missing weight shards {missing}")
    return files


class CheckpointTensor:
    """A checkpoint tensor not read yet. ``narrow`` reads only the rows (or columns) asked for,
    so a tensor-parallel rank loads its own slices of the safetensors files and never the
    others'. The parallel layers' weight loaders take it where they take a tensor."""

    __slots__ = ("_slice", "shape")

    def __init__(self, lazy_slice: Any) -> None:
        self._slice = lazy_slice
        self.shape = torch.Size(lazy_slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]


def iterate_weights(model_dir: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every checkpoint tensor by name, unread: valid until the iteration moves on."""
    for file in safetensors_files(model_dir):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, CheckpointTensor(f.get_slice(name))
        except (OSError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot read weights from {file}: {exc}") from exc


@contextmanager
def _default_dtype_and_device(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def build_model(
    arch: ModelArch,
    max_position: int,
    dtype: torch.dtype,
    device: torch.device,
    state: ParallelState,
    dcp: ParallelState | None = None,
) -> nn.Module:
    cls = model_class(arch.architecture)
    assert cls is not None
    with _default_dtype_and_device(dtype, device):
        model = cls(arch, max_position, state, dcp)
    return model.eval()


def load_model(
    model_dir: str | Path,
    dtype: str,
    device: torch.device,
    state: ParallelState,
    max_model_len: int | None = None,
    dcp: ParallelState | None = None,
    quantization: str = "auto",
) -> tuple[nn.Module, ModelArch, torch.dtype]:
    """Build the model for this rank and load its weight shard, quantized per ``quantization``
    (``workers/quantize.py``). Returns (model, arch, dtype)."""
    path = Path(model_dir)
    arch = read_model_arch(read_hf_config(path))
    torch_dtype = resolve_dtype(dtype, arch.checkpoint_dtype, device)
    quant_mode = resolve_quantization(quantization, path, device)
    max_position = max(max_model_len or 0, arch.max_position_embeddings)
    model = build_model(arch, max_position, torch_dtype, device, state, dcp)
    try:
        loaded = model.load_weights(iterate_weights(path))
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    expected = {n for n, _ in model.named_parameters()}
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    quantize_model(model, quant_mode, path)  # after the check, like packing: weights go
    pack_weights(model)  # after the check: packed layers no longer list their weight
    model.model.fuse_layers()  # holds the weights as packed
    if device.type == "cpu":  # a small batch streams every weight: see workers/huge_pages.py
        done = huge_pages.collapse(huge_pages.module_tensors(model))
        log.info("weights: %.0f MiB in 2 MiB pages", done / 2**20)
    return model, arch, torch_dtype
