"""GGUF checkpoints: a llama.cpp ``.gguf`` file becomes a Hugging Face checkpoint directory.

The engine loads Hugging Face directories (``config.json`` + safetensors), so a GGUF file is
converted once: its metadata becomes ``config.json`` and ``generation_config.json``, its
tokenizer (vocabulary, merges, special tokens, chat template) the tokenizer files, and its
tensors, dequantized, ``model.safetensors`` in float32 (or the dtype asked); the Q4_0, Q4_1 and
Q8_0 linear weights are also kept as they are, in blocks (``workers/gguf_blocks.py``), which
the loader serves quantized by default (``quantization``, ``workers/quantize.py``). The
reading is the ecosystem's: ``gguf``'s reader and dequantization through transformers' GGUF
loader, which also undoes llama.cpp's rotary permutation of the Q/K projections, so the
converted checkpoint computes exactly what ``transformers`` computes when it loads the same
file itself.

``cached_gguf_checkpoint`` converts into the user cache (``$XDG_CACHE_HOME/pagedserve/<stem>``,
default ``~/.cache``) once per file version: a stamp beside the weights records the file's path,
size and modification time, and a changed file converts again. Each conversion is written to a
temporary directory beside the target and renamed into place, so no reader ever sees half of
one. Needs the ``gguf`` package (and ``accelerate`` for transformers' own GGUF loading).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.config import cache_root
from pagedserve.workers.checkpoint_files import save_weights, write_json
from pagedserve.workers.errors import GGUFError, UnsupportedGGUFError

__all__ = [
    "SUPPORTED_GGUF_ARCHITECTURES",
    "GGUFInfo",
    "cache_root",
    "cached_gguf_checkpoint",
    "convert_gguf",
    "find_gguf_file",
    "inspect_gguf",
    "supported_quantization_types",
]

# llama.cpp architecture names whose tensors and metadata map onto the Llama-family models of
# workers/models (llama.cpp writes Mistral checkpoints as "llama" too).
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
STAMP_FILE = "pagedserve-gguf-source.json"
# Bump when the conversion's output changes, so caches convert again (2: the GGUF blocks kept).
FORMAT_VERSION = 2
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True, slots=True)
class GGUFInfo:
    """What a GGUF file holds, read from its header alone."""

    path: Path
    architecture: str
    name: str
    tensor_types: tuple[str, ...]  # the distinct tensor encodings, e.g. ("F32", "Q4_1")
    num_tensors: int
    # The open reader (a memory map), for the conversion to reuse: parsing the header builds
    # every vocabulary entry in Python, seconds per pass on a 49k-token vocabulary.
    reader: Any = field(repr=False, compare=False)


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise GGUFError(
            "reading GGUF checkpoints needs the 'gguf' package: pip install gguf accelerate"
        ) from None
    return gguf


def find_gguf_file(path: str | Path) -> Path:
    """The ``.gguf`` file itself, or the one ``.gguf`` file of a folder."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise GGUFError(f"{path} does not exist")
    found = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise GGUFError(
            f"{path} must hold exactly one .gguf file to serve it (found {names}); "
            "name the file instead"
        )
    return found[0]


def supported_quantization_types() -> list[str]:
    """Tensor encodings that the installed ``gguf`` package can dequantize."""
    gguf = _import_gguf()
    names = {"F32", "F16"}
    traits = getattr(gguf.quants, "_type_traits", None)  # the package's dequantizer registry
    if isinstance(traits, dict):
        names.update(t.name for t in traits)
    return sorted(names)


def _field_text(entry: Any) -> str:
    value = entry.contents()
    return value if isinstance(value, str) else str(value)


def inspect_gguf(path: str | Path) -> GGUFInfo:
    """Read the header of a GGUF file and check that we can convert it.

    Raises ``GGUFError`` for a file that is not GGUF, ``UnsupportedGGUFError`` for an
    architecture or a tensor encoding we cannot read.
    """
    gguf = _import_gguf()
    file = find_gguf_file(path)
    try:
        reader = gguf.GGUFReader(str(file))
    except (OSError, ValueError) as exc:
        raise GGUFError(f"{file} is not a readable GGUF file: {exc}") from exc
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise GGUFError(f"{file} has no general.architecture field")
    arch = _field_text(arch_field)
    name_field = reader.fields.get("general.name")
    name = _field_text(name_field) if name_field is not None else file.stem
    supported = [a for a in SUPPORTED_GGUF_ARCHITECTURES if a in _transformers_gguf_archs()]
    if arch not in supported:
        raise UnsupportedGGUFError(str(file), "architecture", arch, supported)
    types = tuple(sorted({t.tensor_type.name for t in reader.tensors}))
    readable = supported_quantization_types()
    for t in types:
        if t not in readable:
            raise UnsupportedGGUFError(str(file), "quantization type", t, readable)
    return GGUFInfo(file, arch, name, types, len(reader.tensors), reader)


def _transformers_gguf_archs() -> set[str]:
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:  # pragma: no cover - an older transformers: trust our own list
        return set(SUPPORTED_GGUF_ARCHITECTURES)
    return set(GGUF_SUPPORTED_ARCHITECTURES)


def convert_gguf(path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Convert a GGUF file (or the one in a folder) into a Hugging Face checkpoint in
    ``out_dir`` (created; should be empty). Returns ``out_dir``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return _convert(inspect_gguf(path), Path(out_dir), dtype)


def _convert(info: GGUFInfo, out: Path, dtype: str) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from pagedserve.workers.gguf_blocks import write_blocks
    from pagedserve.workers.loader import read_model_arch

    out.mkdir(parents=True, exist_ok=True)
    folder, name = str(info.path.parent), info.path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, OSError) as exc:
        raise GGUFError(f"{info.path}: cannot read the model configuration: {exc}") from exc
    config.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    cfg["dtype"] = dtype
    cfg.pop("torch_dtype", None)
    cfg.pop("_name_or_path", None)
    cfg.pop("_model_name_or_path", None)
    write_json(out / "config.json", cfg)
    read_model_arch(cfg)  # an option our models lack fails here, before the long part

    # The model skeleton on the meta device only names the tensors: transformers maps the GGUF
    # names onto it, dequantizes and reverses the Q/K permutation.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    try:
        tensors: dict[str, torch.Tensor] = load_gguf_checkpoint(
            str(info.path), return_tensors=True, model_to_load=skeleton
        )["tensors"]
    except NotImplementedError as exc:  # an encoding the gguf package cannot dequantize
        raise GGUFError(f"{info.path}: {exc}") from exc
    expected = {n for n, _ in skeleton.named_parameters()}
    if cfg.get("tie_word_embeddings"):
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(tensors))
    if missing:
        raise GGUFError(f"{info.path}: lacks {len(missing)} tensors, e.g. {missing[:3]}")
    torch_dtype = getattr(torch, dtype)
    weights = {k: v.to(torch_dtype).contiguous() for k, v in tensors.items() if k in expected}
    del tensors
    save_weights(weights, out / "model.safetensors")
    write_blocks(info.reader, skeleton, cfg, out)  # served quantized unless asked otherwise

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    return out


def _stamp(file: Path, dtype: str) -> dict[str, Any]:
    st = file.stat()
    return {
        "format": FORMAT_VERSION,
        "source": str(file.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "dtype": dtype,
    }


def _read_stamp(target: Path) -> dict[str, Any] | None:
    try:
        stamp = json.loads((target / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def cached_gguf_checkpoint(
    path: str | Path, dtype: str = "float32", root: str | Path | None = None
) -> Path:
    """The converted checkpoint of a GGUF file (or of the one in a folder), converting it into
    the cache (``root``, default ``cache_root()``) the first time and whenever the file changed.

    The directory is named after the file (``SmolLM2-135M-Instruct.Q4_1`` for
    ``SmolLM2-135M-Instruct.Q4_1.gguf``; a ``-<dtype>`` suffix for other dtypes than float32),
    which is also the name a server gives the model.
    """
    file = find_gguf_file(path)
    stamp = _stamp(file, dtype)
    base = Path(root) if root is not None else cache_root()
    name = file.stem if dtype == "float32" else f"{file.stem}-{dtype}"
    target = base / name
    if _read_stamp(target) == stamp:
        return target
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    info = inspect_gguf(file)  # unsupported files fail before anything is written
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=base))
    start = time.monotonic()
    print(f"pagedserve: converting {file} into a {dtype} Hugging Face checkpoint at {target} "
          "(once per file)", file=sys.stderr, flush=True)
    try:
        _convert(info, tmp, dtype)
        write_json(tmp / STAMP_FILE, stamp)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        _move_into_place(tmp, target, stamp)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"pagedserve: converted {file.name} in {time.monotonic() - start:.1f}s",
          file=sys.stderr, flush=True)
    return target


def _move_into_place(tmp: Path, target: Path, stamp: dict[str, Any]) -> None:
    """Rename ``tmp`` to ``target``, replacing a stale conversion there."""
    old: Path | None = None
    if target.exists():
        if _read_stamp(target) == stamp:
            return  # another process converted the same file meanwhile
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
        target.rename(old / "stale")
    try:
        tmp.rename(target)
    except OSError:
        if _read_stamp(target) != stamp:  # not a concurrent twin of ours: a real failure
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
