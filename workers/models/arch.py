"""What the model code needs from a checkpoint's ``config.json``, read once into a frozen record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.workers.layers.rotary import RopeSettings, rope_settings

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True, slots=True)
class ModelArch:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSettings
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]
    """Per layer: the sliding window in tokens, or None for full attention."""
    hidden_act: str
    checkpoint_dtype: str | None


def _layer_windows(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if window is None:
        return (None,) * num_layers
    if layer_types is None:
        if model_type in ("qwen2", "qwen3"):
            # Qwen's convention: layers from max_window_layers on use the window.
            first = cfg.get("max_window_layers", num_layers)
            layer_types = [SLIDING if i >= first else FULL for i in range(num_layers)]
        else:
            layer_types = [SLIDING] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    for t in layer_types:
        if t not in (SLIDING, FULL):
            raise ValueError(f"unsupported layer type {t!r}")
    return tuple(int(window) if t == SLIDING else None for t in layer_types)


def read_arch(cfg: dict[str, Any], architecture: str) -> ModelArch:
    """Parse a ``config.json`` dict. Raises ``KeyError``/``ValueError`` on missing or bad fields."""
    model_type = cfg.get("model_type", "llama")
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    num_layers = int(cfg["num_hidden_layers"])
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} (only silu)")
    attention_bias = bool(cfg.get("attention_bias", False))
    is_qwen2 = model_type == "qwen2"
    return ModelArch(
        architecture=architecture,
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rope=rope_settings(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if is_qwen2 else attention_bias,
        o_bias=False if is_qwen2 else attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        sliding_windows=_layer_windows(cfg, model_type, num_layers),
        hidden_act=act,
        checkpoint_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
    )
