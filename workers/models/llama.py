"""The Llama family: Llama 2/3, Qwen2/2.5, Qwen3 and Mistral, one implementation.

The variants differ only in switches read into ``ModelArch``: QKV bias (Qwen2), per-head q/k
RMSNorm (Qwen3), per-layer sliding windows (Mistral, hybrid ``layer_types``), tied embeddings
and the RoPE scaling. Layers are tensor-parallel; at tp=1 they are plain linears.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.kernels.decoder_layer import LayerWeights
from pagedserve.parallel.linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from pagedserve.parallel.state import ParallelState
from pagedserve.workers.layers.activation import SiluAndMul
from pagedserve.workers.layers.attention import PagedAttention
from pagedserve.workers.layers.norm import RMSNorm
from pagedserve.workers.layers.rotary import RotaryEmbedding
from pagedserve.workers.models.arch import ModelArch
from pagedserve.workers.models.fused_layers import layer_weights, run_layers

# checkpoint sub-name -> (our fused parameter, shard id)
_STACKED = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        layer_index: int,
        max_position: int,
        state: ParallelState,
        dcp: ParallelState | None = None,
    ) -> None:
        super().__init__()
        d = arch.head_dim
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, d, arch.num_heads, arch.num_kv_heads, arch.qkv_bias, state
        )
        self.o_proj = RowParallelLinear(arch.num_heads * d, arch.hidden_size, arch.o_bias, state)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.q_norm = RMSNorm(d, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(d, arch.rms_norm_eps) if arch.qk_norm else None
        self.rotary = RotaryEmbedding(d, max_position, arch.rope)
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            d,
            d**-0.5,
            layer_index,
            arch.sliding_windows[layer_index],
            dcp,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        t = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)  # contiguous results
        out = self.attn(q, k, v)  # v stays a view: the cache write reads it through its strides
        return self.o_proj(out.view(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArch, state: ParallelState) -> None:
        super().__init__()
        i = arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            arch.hidden_size, [i, i], arch.mlp_bias, state
        )
        self.down_proj = RowParallelLinear(i, arch.hidden_size, arch.mlp_bias, state)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        layer_index: int,
        max_position: int,
        state: ParallelState,
        dcp: ParallelState | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, layer_index, max_position, state, dcp)
        self.mlp = LlamaMLP(arch, state)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x: the previous layer's MLP output [T, hidden], not yet added to the residual stream
        # (layer 0: the embedding, which starts the stream). Each residual add happens inside
        # the norm that follows it, in the model dtype and in the reference's order; returns
        # (MLP output, residual stream), the last add left to the next norm.
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        max_position: int,
        state: ParallelState,
        dcp: ParallelState | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, state)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, i, max_position, state, dcp) for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # Per layer, the compiled whole-layer call's arguments where it serves (fuse_layers).
        self.fused: list[LayerWeights | None] = [None] * arch.num_layers

    def fuse_layers(self) -> int:
        """Take the compiled whole-layer path where it serves (after loading and packing:
        it holds the weights as they are then). Returns how many layers take it."""
        self.fused = [layer_weights(layer) for layer in self.layers]
        return sum(w is not None for w in self.fused)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden [T, hidden]
        x = self.embed_tokens(input_ids)
        x, residual = run_layers(self.layers, self.fused, positions, x)
        return self.norm(x, residual)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns hidden states; ``compute_logits`` projects only the rows asked for.

    ``state`` is the tensor-parallel group; ``dcp`` the decode-context-parallel subgroup of it.
    """

    def __init__(
        self,
        arch: ModelArch,
        max_position: int,
        state: ParallelState,
        dcp: ParallelState | None = None,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch, max_position, state, dcp)
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, state)
        if arch.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, vocab] float32 (the head's own result)
        return self.lm_head(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def checkpoint_target(self, name: str) -> tuple[str, str | int | None]:
        """The parameter a checkpoint tensor loads into and its shard id in a fused weight
        (None where the parameter is the tensor's own)."""
        for ckpt_part, ours, shard_id in _STACKED:
            if f".{ckpt_part}." in name:
                return name.replace(ckpt_part, ours), shard_id
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors by Hugging Face name; returns the parameter names filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue  # tied checkpoints sometimes store both copies
            target, shard_id = self.checkpoint_target(name)
            if target not in params:
                raise KeyError(f"unexpected checkpoint tensor {name!r}")
            param = params[target]
            if shard_id is not None:
                param.weight_loader(param, tensor, shard_id)
            else:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(target)
        return loaded
