"""The files of a Hugging Face checkpoint directory as this package writes them (the demo
checkpoint, GGUF conversions)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["save_weights", "write_json"]


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """Sorted and indented, so that two writes of the same checkpoint are the same bytes."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def save_weights(tensors: dict[str, Any], path: Path) -> None:
    """``tensors`` (name -> torch tensor) as a safetensors file readable by every user of the
    cache (safetensors creates it owner-only)."""
    from safetensors.torch import save_file  # torch: only where weights are written

    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)
