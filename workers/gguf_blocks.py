"""GGUF's Q4_0, Q4_1 and Q8_0 blocks kept beside a converted checkpoint, to serve them quantized.

The conversion (``workers/gguf_checkpoint.py``) dequantizes every tensor into
``model.safetensors``, which transformers and ``quantization="none"`` read. ``write_blocks``
also copies the decoder's linear weights that are stored in one of ``SERVED_TYPES`` into
``quantized/gguf-blocks.safetensors``, byte for byte: one uint8 tensor ``[out, row_bytes]`` per
Hugging Face name, the encoding in the file's metadata. The rows go through the same tensor
processor as transformers' own loader, so the Q/K rotary permutation it undoes on the
dequantized weights (a permutation of output rows; a block never spans two rows) is undone on
the blocks too. Embeddings, norms and the LM head stay dequantized (as they are served).

``read_blocks`` decodes them (llama.cpp's block layouts, ``ggml-common.h``):

- Q4_0, 18 bytes per 32 weights: fp16 d, 16 bytes of nibbles; ``w = d * (q - 8)``;
- Q4_1, 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles; ``w = d * q + m``;
- Q8_0, 34 bytes: fp16 d, 32 int8; ``w = d * q``.

Byte j of a Q4 block holds weight j in its low nibble and weight j + 16 in its high nibble.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["BLOCKS_FILE", "SERVED_TYPES", "GGUFBlocks", "decode_rows", "read_blocks",
           "write_blocks"]

BLOCKS_FILE = Path("quantized") / "gguf-blocks.safetensors"  # outside the *.safetensors glob
SERVED_TYPES = ("Q4_0", "Q4_1", "Q8_0")
BLOCK = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
_KEEP_DEQUANTIZED = ("embed_tokens", "lm_head")


@dataclass(frozen=True, slots=True)
class GGUFBlocks:
    """One weight's blocks, decoded: ``codes`` [out, in] (uint8 0..15 for Q4, int8 for Q8_0)
    and per-block ``scales`` [out, in / 32] float32 (the fp16 d, exactly); for Q4, ``zeros``
    in the int4 kernel's convention ``w = (q - 8) * scale + zero`` (Q4_1: m + 8 d; Q4_0: 0)."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None

    def dequantize(self) -> torch.Tensor:
        """The weight in float64 [out, in]."""
        s = self.scales.double().repeat_interleave(BLOCK, dim=1)
        if self.zeros is None:
            return self.codes.double() * s
        z = self.zeros.double().repeat_interleave(BLOCK, dim=1)
        return (self.codes.double() - 8.0) * s + z


def decode_rows(raw: torch.Tensor, kind: str) -> GGUFBlocks:
    """raw: uint8 [out, blocks * block_bytes] of ``kind`` -> its codes and scales."""
    size = _BLOCK_BYTES[kind]
    n, row_bytes = raw.shape
    if row_bytes % size:
        raise ValueError(f"a {kind} row of {row_bytes} bytes is not whole blocks of {size}")
    b = raw.contiguous().view(n, row_bytes // size, size)  # [out, blocks, block_bytes]
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()  # [out, blocks]
    if kind == "Q8_0":
        codes = b[..., 2:].contiguous().view(torch.int8).reshape(n, -1)
        return GGUFBlocks(kind, codes, d, None)
    start = 4 if kind == "Q4_1" else 2
    qs = b[..., start:]  # [out, blocks, 16]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, -1)  # weights j, then j + 16
    if kind == "Q4_1":
        m = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        zeros = m + 8.0 * d  # d * q + m == d * (q - 8) + (m + 8 d)
    else:
        zeros = torch.zeros_like(d)
    return GGUFBlocks(kind, codes, d, zeros)


def write_blocks(reader: Any, skeleton: Any, config: dict[str, Any], out_dir: Path) -> int:
    """Copy the served-quantized linear weights of a GGUF file (its open ``gguf.GGUFReader``)
    into ``out_dir/BLOCKS_FILE``; returns how many (none: no file written). ``skeleton`` is the
    transformers model (meta device) the names map onto; ``config`` transformers' parsed GGUF
    config."""
    from safetensors.torch import save_file
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    arch = str(reader.fields["general.architecture"].contents())
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
    names = get_gguf_hf_weights_map(skeleton, processor)
    blocks: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        hf_name = names.get(tensor.name)
        if kind not in SERVED_TYPES or hf_name is None or not hf_name.endswith(".weight"):
            continue
        if any(part in hf_name for part in _KEEP_DEQUANTIZED) or tensor.data.ndim != 2:
            continue
        rows = processor.process(weights=np.asarray(tensor.data), name=tensor.name).weights
        blocks[hf_name] = torch.from_numpy(np.array(rows, dtype=np.uint8))  # a writable copy
        kinds[hf_name] = kind
    if blocks:
        file = out_dir / BLOCKS_FILE
        file.parent.mkdir(parents=True, exist_ok=True)
        save_file(blocks, str(file), metadata=kinds)
        file.chmod(0o644)  # readable by every user of the cache (safetensors: owner-only)
    return len(blocks)


def read_blocks(model_dir: str | Path) -> dict[str, GGUFBlocks] | None:
    """The decoded blocks of a converted checkpoint by Hugging Face name; None without any."""
    from safetensors import safe_open

    file = Path(model_dir) / BLOCKS_FILE
    if not file.is_file():
        return None
    out: dict[str, GGUFBlocks] = {}
    with safe_open(str(file), framework="pt", device="cpu") as f:
        kinds = f.metadata() or {}
        for name in f.keys():
            out[name] = decode_rows(f.get_tensor(name), kinds[name])
    return out
