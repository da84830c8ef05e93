"""A small demo checkpoint in real Hugging Face format, written deterministically.

Random (seeded) Llama weights, a byte-level BPE tokenizer trained on the text below, and the
usual side files (``config.json``, ``generation_config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` with a chat template). The same bytes come out
every time, so the demo model's outputs are reproducible across machines.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pagedserve.config import cache_root
from pagedserve.workers.checkpoint_files import save_weights, write_json

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2
DEMO_VOCAB_SIZE = 512
DEMO_SEED = 1234

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Training text for the tokenizer (written for this project).
_CORPUS = """\
A paged cache splits the memory of every sequence into fixed blocks, so that no request has to
reserve room for tokens it may never produce. The scheduler hands out blocks as tokens arrive and
takes them back when a request finishes. Shared prefixes point at the same blocks, and a block is
copied only when one of its readers writes to it.
The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the warm sun while the fox
runs through the tall green grass of the meadow near the river.
Hello, world! How are you today? I am fine, thank you. What would you like to talk about?
Let us write a short story about a robot who learns to paint the sea at night, one small wave at
a time, until the whole wall of the harbour is covered in blue and silver light.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
The model reads the prompt, writes its keys and values into the cache, and then produces one new
token at each step, reading back everything it has written so far.
"""


def build_tokenizer(vocab_size: int = DEMO_VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE tokenizer trained on the embedded text (deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return tok


def write_tokenizer(path: str | Path, model_max_length: int = 2048) -> Tokenizer:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``path``."""
    path = Path(path)
    tok = build_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    write_json(
        path / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "add_bos_token": True,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    return tok


def demo_config() -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": DEMO_VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "initializer_range": 0.02,
        "dtype": "bfloat16",
    }


def _random_weights(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(DEMO_SEED)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    std = cfg["initializer_range"]

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    w = {"model.embed_tokens.weight": normal(v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        w[p + "self_attn.q_proj.weight"] = normal(q, h)
        w[p + "self_attn.k_proj.weight"] = normal(kv, h)
        w[p + "self_attn.v_proj.weight"] = normal(kv, h)
        w[p + "self_attn.o_proj.weight"] = normal(h, q)
        w[p + "mlp.gate_proj.weight"] = normal(i, h)
        w[p + "mlp.up_proj.weight"] = normal(i, h)
        w[p + "mlp.down_proj.weight"] = normal(h, i)
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    w["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    w["lm_head.weight"] = normal(v, h)
    return w


def write_demo_checkpoint(path: str | Path) -> Path:
    """Write the demo checkpoint into ``path`` (created if needed); returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = demo_config()
    write_json(path / "config.json", cfg)
    write_json(
        path / "generation_config.json",
        {
            "bos_token_id": cfg["bos_token_id"],
            "eos_token_id": cfg["eos_token_id"],
            "pad_token_id": cfg["pad_token_id"],
        },
    )
    save_weights(_random_weights(cfg), path / "model.safetensors")
    write_tokenizer(path, cfg["max_position_embeddings"])
    return path


def demo_checkpoint_dir() -> Path:
    """The demo checkpoint in the user cache, written on first use."""
    target = cache_root() / "demo-model"
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename, so a concurrent reader never sees half a checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=".demo-model-", dir=target.parent))
    try:
        write_demo_checkpoint(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "model.safetensors").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
