"""Model classes by the ``architectures`` name of a checkpoint's ``config.json``."""

from __future__ import annotations

from torch import nn

from pagedserve.workers.models.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class(architecture: str) -> type[nn.Module] | None:
    return _REGISTRY.get(architecture)
