"""Tiny GGUF files for tests, written with ``gguf.GGUFWriter`` as llama.cpp lays them out.

``write_gguf_from_hf(model_dir, out, types=...)`` writes a Llama checkpoint directory's tensors
(Q/K permuted for rotary the way llama.cpp stores them), each in float32 or in the GGUF
encoding ``types`` names for its llama.cpp tensor name (``{"attn_q": "Q4_1", ...}``), with the
directory's tokenizer and the demo chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedserve.workers.demo import CHAT_TEMPLATE


def permute_for_rotary(w: Any, n_head: int) -> Any:
    """llama.cpp's storage order of a Q/K projection: each head's two rotary halves
    interleaved pairwise (what the converter must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def _tokenizer_fields(writer: Any, model_dir: Path) -> None:
    import gguf

    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)


def _add(writer: Any, name: str, w: Any, types: dict[str, str]) -> None:
    import gguf
    import numpy as np

    kind = types.get(name.removeprefix("blk.").split(".")[-2] if name.startswith("blk.")
                     else name.removesuffix(".weight"))
    w = np.ascontiguousarray(w)
    if kind is None:
        writer.add_tensor(name, w)
        return
    qtype = gguf.GGMLQuantizationType[kind]
    writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)


def write_gguf_from_hf(
    model_dir: Path, out: Path, arch: str = "llama", types: dict[str, str] | None = None
) -> Path:
    """A GGUF of a Llama checkpoint directory, named and laid out as llama.cpp does; float32
    except the tensors ``types`` names (llama.cpp names without ``blk.N.``/``.weight``)."""
    import gguf
    import torch
    from safetensors.torch import load_file

    types = types or {}
    cfg = json.loads((model_dir / "config.json").read_text())
    tensors = load_file(model_dir / "model.safetensors")
    weights = {k: v.to(torch.float32).numpy() for k, v in tensors.items()}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    theta = cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name("pagedserve demo")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    writer.add_vocab_size(cfg["vocab_size"])
    _tokenizer_fields(writer, model_dir)
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    _add(writer, "token_embd.weight", weights["model.embed_tokens.weight"], types)
    for n in range(cfg["num_hidden_layers"]):
        for hf_name, gguf_name in names.items():
            w = weights[f"model.layers.{n}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                w = permute_for_rotary(w, heads)
            elif gguf_name == "attn_k":
                w = permute_for_rotary(w, kv_heads)
            _add(writer, f"blk.{n}.{gguf_name}.weight", w, types)
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    if "lm_head.weight" in weights:
        _add(writer, "output.weight", weights["lm_head.weight"], types)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
