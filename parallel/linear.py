"""Tensor-parallel linear and embedding layers with checkpoint-slicing weight loaders.

Every parameter carries a ``weight_loader(param, full_tensor[, shard_id])`` that receives the
*full* checkpoint tensor and copies this rank's slice into ``param``. Column-parallel layers
split the output dim, row-parallel layers the input dim (then all-reduce). At ``size == 1``
no process group is needed and the loaders copy the whole tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.linear import PACK_MIN_ELEMENTS, linear, pack_weight
from pagedserve.kernels.quant_linear import Int4Weight, Int8Weight, quantized_linear
from pagedserve.parallel import comm
from pagedserve.parallel.state import ParallelState, divide


def _param(*shape: int) -> nn.Parameter:
    # Uninitialised: every value is overwritten by the loader (or by a test's own init).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _copy(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter. ``loaded`` may also be a lazy checkpoint
    tensor (anything with ``shape`` and ``narrow``): its slices are read only here."""
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, loaded {tuple(loaded.shape)}"
        )
    if not isinstance(loaded, torch.Tensor):
        loaded = loaded.narrow(0, 0, loaded.shape[0])  # read it whole
    param.data.copy_(loaded)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Replicated parameters (norms, biases of row-parallel layers): copy as is."""
    _copy(param, loaded)


class _PackableWeight(nn.Module):
    """A layer whose ``weight`` moves, after loading, into the layout ``kernels.linear`` packs
    for the CPU; the packed copy then replaces the parameter (one copy in memory). A quantized
    weight (``use_quantized``, ``workers/quantize.py``) replaces it likewise."""

    packed: torch.Tensor | None = None
    quant: Int8Weight | Int4Weight | None = None

    def use_quantized(self, weight: Int8Weight | Int4Weight) -> None:
        self.quant = weight
        self.packed = None
        self.weight = None

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        # out_dtype: the result's (default x's), written by the int8 kernel's epilogue itself
        if self.quant is not None:
            return quantized_linear(x, self.quant, bias, out_dtype)
        y = linear(x, self.weight, self.packed, bias)
        return y if out_dtype is None else y.to(out_dtype)

    def pack(self, keep_weight: bool = False) -> bool:
        if self.quant is not None or self.weight.numel() < PACK_MIN_ELEMENTS:
            return False
        packed = pack_weight(self.weight)
        if packed is None:
            return False
        self.packed = packed
        if not keep_weight:
            self.weight = None
        return True


def pack_weights(model: nn.Module) -> int:
    """Pack every linear weight of a loaded model where the CPU path exists; returns how many
    were packed (0 on GPU, in other dtypes, or with neither the tiled kernel nor oneDNN;
    weights under ``PACK_MIN_ELEMENTS`` stay plain)."""
    return sum(m.pack() for m in model.modules() if isinstance(m, _PackableWeight))


class ColumnParallelLinear(_PackableWeight):
    """``y = x W^T + b`` with W split by output rows: rank r holds rows ``[r*n/tp, (r+1)*n/tp)``."""

    def __init__(self, input_size: int, output_size: int, bias: bool, state: ParallelState) -> None:
        super().__init__()
        self.state = state
        self.input_size = input_size
        self.output_size_per_rank = divide(output_size, state.size)
        self.weight = _param(self.output_size_per_rank, input_size)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param(self.output_size_per_rank) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        n = param.shape[0]
        _copy(param, loaded.narrow(0, self.state.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out / tp]
        return self._matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused along the output dim (e.g. gate + up).

    The checkpoint stores them separately; ``weight_loader(param, w, shard_id)`` places the
    rank's slice of projection ``shard_id`` at its offset in the fused weight.
    """

    def __init__(
        self, input_size: int, output_sizes: Sequence[int], bias: bool, state: ParallelState
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, state)

    def weight_loader(  # type: ignore[override]
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int
    ) -> None:
        tp = self.state.size
        size = divide(self.output_sizes[shard_id], tp)
        offset = sum(divide(s, tp) for s in self.output_sizes[:shard_id])
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, self.state.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused Q, K, V projections split by heads.

    Query heads are divided evenly. KV heads are divided when ``tp <= num_kv_heads`` and
    replicated otherwise (each rank keeps the one KV head its query heads attend to).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        state: ParallelState,
    ) -> None:
        tp = state.size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp)
        if tp <= num_kv_heads:
            self.num_kv_heads = divide(num_kv_heads, tp)
            self.kv_head_start = state.rank * self.num_kv_heads
        else:
            divide(tp, num_kv_heads)
            self.num_kv_heads = 1
            self.kv_head_start = state.rank // (tp // num_kv_heads)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        # The per-rank output is q + k + v; build with the full-size equivalent.
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp, bias, state)

    def weight_loader(  # type: ignore[override]
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str
    ) -> None:
        d = self.head_dim
        if shard_id == "q":
            dst_off, size, src_off = 0, self.q_size, self.state.rank * self.q_size
        elif shard_id in ("k", "v"):
            dst_off = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, src_off = self.kv_size, self.kv_head_start * d
        else:
            raise ValueError(f"unknown QKV shard {shard_id!r}")
        _copy(param.data.narrow(0, dst_off, size), loaded.narrow(0, src_off, size))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # qkv: [T, q + 2 kv] -> q [T, q], k [T, kv], v [T, kv]
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(_PackableWeight):
    """``y = x W^T + b`` with W split by input columns; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool, state: ParallelState) -> None:
        super().__init__()
        self.state = state
        self.input_size_per_rank = divide(input_size, state.size)
        self.weight = _param(output_size, self.input_size_per_rank)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param(output_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        n = param.shape[1]
        _copy(param, loaded.narrow(1, self.state.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in / tp] -> [T, out]; the bias is added once, after the reduction.
        y = comm.all_reduce(self._matmul(x, None), self.state)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; tokens outside a rank's range embed to zero."""

    def __init__(self, vocab_size: int, embedding_dim: int, state: ParallelState) -> None:
        super().__init__()
        self.state = state
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // state.size)
        self.vocab_start = state.rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.weight = _param(self.rows_per_rank, embedding_dim)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        n = self.vocab_end - self.vocab_start
        param.data.zero_()  # padding rows of the last rank stay zero
        _copy(param.data.narrow(0, 0, n), loaded.narrow(0, self.vocab_start, n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, dim]
        if self.state.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_end - self.vocab_start)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        return comm.all_reduce(y, self.state)


class ParallelLMHead(VocabParallelEmbedding, _PackableWeight):
    """Output projection split by vocabulary rows; logits are gathered over ranks.

    ``tie_to(embedding)`` shares the embedding's weight (Qwen2 small models, tied checkpoints);
    packing a tied head keeps that weight, which the embedding still reads.
    """

    tied = False

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.tied = True

    def untie(self, weight: torch.Tensor) -> None:
        """Read ``weight`` [vocab rows of this rank, dim] of the head's own from now on (a
        rotated model's head folds the final norm in, where its embedding does not)."""
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.tied = False

    def pack(self, keep_weight: bool = False) -> bool:
        return super().pack(keep_weight or self.tied)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, dim] -> logits [N, vocab] float32; across ranks gathered in the model
        # dtype (half the bytes at bf16), widened after
        one_rank = self.state.size == 1
        logits = self._matmul(hidden, None, torch.float32 if one_rank else None)
        if not one_rank:
            logits = comm.all_gather(logits, self.state, dim=-1)
        return logits[..., : self.vocab_size].float()
