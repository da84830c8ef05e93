"""pagedserve: a distributed LLM serving engine built on PagedAttention.

``import pagedserve`` stays light (no torch, no ray): the engine-facing names are loaded on
first use.
"""

from __future__ import annotations

from typing import Any

from pagedserve.config import ConfigError, EngineConfig

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "ConfigError",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

_LAZY = {
    "LLM": "pagedserve.serving.llm",
    "SamplingParams": "pagedserve.messages",
    "RequestOutput": "pagedserve.messages",
    "CompletionOutput": "pagedserve.messages",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
