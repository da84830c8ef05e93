"""Weight quantization of a loaded model: ``ModelConfig.quantization``.

- ``none``: the weights as loaded (a GGUF file's dequantized float weights).
- ``int8``: every decoder linear weight and the LM head become int8 per output channel
  (``kernels/quant_linear.py``), quantized once here from the loaded weights, and batched rows
  of every one of them run with dynamic int8 activations (one scale per row). The embeddings
  keep the model dtype (a tied head's table stays for the embedding; the head's int8 copy
  replaces its packed one). One scale per row fits only where no channel runs far larger
  than the rest, which a decoder's activations break: the residual stream carries a few huge
  channels, the attention output some per head, the MLP's SiLU-gated product the largest of
  the layer. So before quantizing, the model is rotated (``workers/rotation.py``: exact,
  folded into the weights: the residual stream by a random orthogonal matrix, each value
  head by a Hadamard matrix), and the inputs of the down projection and of the head take a
  Hadamard rotation online (``quantize_int8(..., hadamard=)``: folded into the weight, the
  activation rotated by a fast transform). On SmolLM2, against bf16 perplexity
  (``benchmarks/scripts/perplexity.py``): dynamic activations in all four projections without
  the rotations +4.5%; with them +1.0% (its own text) and +1.5% (a longer one), within the 2%
  bound, where the int8 weights alone account for +0.5-1.3% and the two texts' spread between
  settings is about half a percent. Without rotations only the attention output and gate/up
  could take dynamic activations (QKV +2.6%, down +1.1% alone), which left half of each layer
  on the weight-only kernel at a batch. ``docs/results/quantization.md`` has the figures.
- ``gguf``: a checkpoint converted from a GGUF file serves its linear weights from the file's
  blocks (``workers/gguf_blocks.py``): a layer whose parts are all Q4_0/Q4_1 becomes int4 in
  groups of 32, the blocks' own codes, scales and offsets (exact up to the bfloat16 rounding
  of the scales the kernel takes); a layer of Q8_0 parts becomes int8 per output channel,
  requantized from the exact dequantized weight (no kernel takes per-32 int8 scales: the
  closest it gets; each weight moves by at most half a per-channel step). Layers in other
  encodings, mixing encodings, or whose rank slice is not whole blocks keep the dequantized
  weight. Only on the CPU, where the int4 kernel runs; elsewhere the dequantized weights stay.
- ``auto`` (the default): ``gguf`` for a checkpoint that has such blocks, so a Q4 file runs
  quantized as it does under llama.cpp; ``none`` for every other checkpoint.

The layers' own weight loaders place the blocks' codes, scales and offsets, so fused (QKV,
gate/up) and tensor-parallel layers slice them exactly as they slice the weights.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from pagedserve.kernels.quant_linear import (
    GROUP_SIZE,
    Int8Weight,
    hadamard_block,
    pack_int4,
    quantize_int8,
)
from pagedserve.parallel.linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    _PackableWeight,
)
from pagedserve.workers.errors import ModelLoadError
from pagedserve.workers.gguf_blocks import BLOCKS_FILE, GGUFBlocks, read_blocks
from pagedserve.workers.rotation import rotate_residual_stream

__all__ = ["QuantizationReport", "quantize_model", "resolve_quantization"]

logger = logging.getLogger(__name__)

# The projections of an unrotated model (GGUF Q8_0 layers) whose batched rows take dynamic
# int8 activations: those whose inputs hold no large outliers (module docstring).
_DYNAMIC_UNROTATED = ("o_proj", "gate_up_proj")
# The projection whose input no weight fold can rotate (it follows the SiLU gate); the LM head's
# input (the final norm's output) takes an online rotation too.
_ONLINE_ROTATION = "down_proj"


@dataclass(slots=True)
class QuantizationReport:
    """What ``quantize_model`` did: the mode applied and the layers per weight layout."""

    mode: str
    layers: dict[str, int] = field(default_factory=dict)  # "int8" / "int4" / "float" -> count

    def count(self, kind: str) -> None:
        self.layers[kind] = self.layers.get(kind, 0) + 1


def resolve_quantization(requested: str, model_dir: str | Path, device: torch.device) -> str:
    """``auto`` -> ``gguf`` where the checkpoint holds GGUF blocks and the device is the CPU,
    else ``none``; ``gguf`` without blocks or off the CPU is a ``ModelLoadError``."""
    has_blocks = (Path(model_dir) / BLOCKS_FILE).is_file()
    if requested == "auto":
        return "gguf" if has_blocks and device.type == "cpu" else "none"
    if requested == "gguf" and device.type != "cpu":
        raise ModelLoadError(
            f"quantization='gguf' runs on the CPU only (its int4 kernel); this worker is on "
            f"{device.type}: use 'none' for the dequantized weights"
        )
    if requested == "gguf" and not has_blocks:
        raise ModelLoadError(
            f"quantization='gguf' needs a checkpoint converted from a GGUF file with Q4_0, Q4_1 "
            f"or Q8_0 weights; {model_dir} has none (use 'int8' to quantize its weights)"
        )
    return requested


def _linear_layers(model: nn.Module) -> dict[str, _PackableWeight]:
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, _PackableWeight) and not isinstance(m, ParallelLMHead)
    }


def quantize_model(model: nn.Module, mode: str, model_dir: str | Path) -> QuantizationReport:
    """Replace the loaded model's linear weights per ``mode`` (resolved: none, int8, gguf)."""
    report = QuantizationReport(mode)
    layers = _linear_layers(model)
    if mode == "int8":
        rotate_residual_stream(model)
        for name, layer in layers.items():
            online = name.endswith(_ONLINE_ROTATION)
            layer.use_quantized(_rotated_int8(layer, online))
            report.count("int8")
        model.lm_head.use_quantized(_rotated_int8(model.lm_head, True))
        report.count("int8")
    elif mode == "gguf":
        _serve_gguf_blocks(model, layers, read_blocks(model_dir) or {}, report)
    if mode != "none":
        _release_freed_memory()
        logger.info("quantization %s: %s", mode, report.layers)
    return report


def _rotated_int8(layer: _PackableWeight, online: bool) -> Int8Weight:
    """The layer's weight in int8 per channel, dynamic activations at a batch; ``online``: its
    input takes a Hadamard rotation first (module docstring)."""
    k = layer.weight.shape[1]
    return quantize_int8(layer.weight, hadamard=hadamard_block(k) if online else 0)


def _unrotated_int8(name: str, layer: _PackableWeight) -> Int8Weight:
    """A GGUF Q8_0 layer in int8 per channel; dynamic activations where the module docstring
    says."""
    return quantize_int8(layer.weight, dynamic=name.rpartition(".")[2] in _DYNAMIC_UNROTATED)


def _release_freed_memory() -> None:
    """Hand the freed float weights' pages back to the OS. glibc keeps freed heap memory
    resident (the layers' float weights are a few MiB each, under its grown mmap threshold),
    so without this the process stays near its float size: SmolLM2 served from its Q4_1
    blocks holds 507 MiB resident after the load, 360 MiB after the trim
    (``benchmarks/scripts/quant_memory.py``). A no-op off glibc."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is not None:
        trim(0)


def _parts(layer: _PackableWeight) -> int:
    """How many checkpoint tensors fill the layer's weight."""
    if isinstance(layer, QKVParallelLinear):
        return 3
    if isinstance(layer, MergedColumnParallelLinear):
        return len(layer.output_sizes)
    return 1


def _serve_gguf_blocks(
    model: nn.Module,
    layers: dict[str, _PackableWeight],
    blocks: dict[str, GGUFBlocks],
    report: QuantizationReport,
) -> None:
    target: Callable[[str], tuple[str, str | int | None]] = model.checkpoint_target
    sources: dict[str, list[tuple[str | int | None, GGUFBlocks]]] = {}
    for name, b in blocks.items():
        param_name, shard_id = target(name)
        layer_name = param_name.removesuffix(".weight")
        if layer_name in layers:
            sources.setdefault(layer_name, []).append((shard_id, b))
    for name, layer in layers.items():
        parts = sources.get(name, [])
        kinds = {b.kind for _, b in parts}
        if len(parts) != _parts(layer) or len(kinds) != 1:
            report.count("float")
        elif kinds == {"Q8_0"}:
            layer.use_quantized(_unrotated_int8(name, layer))
            report.count("int8")
        elif _load_int4(layer, parts):
            report.count("int4")
        else:
            report.count("float")


def _load_int4(layer: _PackableWeight, parts: list[tuple[str | int | None, GGUFBlocks]]) -> bool:
    """Place each part's codes, scales and zeros through the layer's weight loader (the rows and
    columns this rank holds), then pack them; False where the slice is not whole blocks."""
    n, k = layer.weight.shape
    if k % GROUP_SIZE:
        return False
    codes = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, k // GROUP_SIZE)
    zeros = torch.empty(n, k // GROUP_SIZE)
    loader = layer.weight_loader
    for shard_id, b in parts:
        assert b.zeros is not None
        for dst, src in ((codes, b.codes), (scales, b.scales), (zeros, b.zeros)):
            if shard_id is None:
                loader(dst, src)
            else:
                loader(dst, src, shard_id)  # type: ignore[call-arg]
    # A row-parallel rank's columns start at rank * k: whole blocks only if k is (checked),
    # and its scales were sliced at rank * k / 32, the same columns.
    try:
        weight = pack_int4(codes, scales, zeros)
    except ValueError:
        return False
    layer.use_quantized(weight)
    return True
