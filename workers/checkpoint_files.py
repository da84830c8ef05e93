"""The files of a Hugging Face checkpoint directory as this package writes them (the demo
checkpoint, GGUF conversions), and the user cache they are written into."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["cache_root", "save_weights", "write_json"]


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/pagedserve`` (default ``~/.cache/pagedserve``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedserve"


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """Sorted and indented, so that two writes of the same checkpoint are the same bytes."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def save_weights(tensors: dict[str, Any], path: Path) -> None:
    """``tensors`` (name -> torch tensor) as a safetensors file readable by every user of the
    cache (safetensors creates it owner-only)."""
    from safetensors.torch import save_file  # torch: only where weights are written

    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)
