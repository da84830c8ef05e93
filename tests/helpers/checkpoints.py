"""Tiny random Hugging Face checkpoints for tests: ``make_checkpoint(kind, path, **overrides)``.

Kinds: ``llama`` (llama3 RoPE scaling), ``qwen2`` (QKV bias, tied embeddings), ``qwen3`` (q/k
norm, head_dim != hidden/heads), ``mistral`` (sliding window 8 on every layer), ``hybrid``
(Qwen2 with ``layer_types`` alternating sliding/full attention). Saved in float32 with
``save_pretrained(safe_serialization=True)``, plus the demo byte-level tokenizer (vocab 512),
so the directory works for transformers, our loader and the engine alike. ``overrides`` go to
the transformers config class; ``seed`` and ``init_std`` (default 0.2, so that attention and
the argmax actually depend on the input) are taken out first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

KINDS = ("llama", "qwen2", "qwen3", "mistral", "hybrid")

_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def _config(kind: str, overrides: dict[str, Any]) -> Any:
    import transformers as tf

    if kind == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return tf.LlamaConfig(**{**_COMMON, "rope_parameters": rope, **overrides})
    if kind == "qwen2":
        return tf.Qwen2Config(**{**_COMMON, "tie_word_embeddings": True, **overrides})
    if kind == "qwen3":
        return tf.Qwen3Config(**{**_COMMON, "head_dim": 32, **overrides})
    if kind == "mistral":
        return tf.MistralConfig(**{**_COMMON, "sliding_window": 8, **overrides})
    if kind == "hybrid":
        layers = overrides.pop("num_hidden_layers", 4)
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return tf.Qwen2Config(
            **{
                **_COMMON,
                "num_hidden_layers": layers,
                "use_sliding_window": True,
                "sliding_window": 8,
                "max_window_layers": 0,
                "layer_types": types,
                **overrides,
            }
        )
    raise ValueError(f"unknown checkpoint kind {kind!r}; one of {KINDS}")


def make_checkpoint(kind: str, path: str | Path, **overrides: Any) -> Path:
    """Write a tiny random checkpoint of ``kind`` into ``path``; returns the path."""
    import torch
    import transformers as tf

    from pagedserve.workers.demo import write_tokenizer

    seed = overrides.pop("seed", 0)
    std = overrides.pop("init_std", 0.2)
    config = _config(kind, dict(overrides))
    path = Path(path)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, config.max_position_embeddings)
    return path


def load_hf_model(path: str | Path) -> Any:
    """The same checkpoint in transformers, float32, eager attention, eval mode."""
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    model.generation_config.eos_token_id = None  # compare fixed-length continuations
    return model.eval()


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of one prompt by transformers (no padding involved)."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def perturbed_copy(src: Path, dst: Path, noise: float, seed: int = 1) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` whose every tensor has Gaussian noise of std
    ``noise`` added: a draft model that agrees with its target most of the time."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    noisy = {k: v + noise * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
    save_file(noisy, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def repeating_prompts(seed: int, lens: tuple[int, ...] = (3, 17, 40, 70)) -> list[list[int]]:
    """Random prompts (ids 3-511) of the given lengths, each followed by its first half again,
    so that prompt lookup finds matches in them."""
    import random

    rng = random.Random(seed)
    out = []
    for n in lens:
        head = [rng.randrange(3, 512) for _ in range(n)]
        out.append(head + head[: n // 2])
    return out
