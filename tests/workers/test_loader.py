"""Loader: single-file and sharded checkpoints, dtype resolution, typed errors."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from pagedserve.kernels import cpu_caps
from pagedserve.parallel.state import ParallelState
from pagedserve.workers.errors import ModelLoadError, UnsupportedModelError
from pagedserve.workers.loader import load_model, resolve_dtype

CPU = torch.device("cpu")


def test_sharded_checkpoint_loads_the_same_weights(checkpoint_dir, checkpoints, tmp_path):
    single = checkpoint_dir("qwen3")
    hf = checkpoints.load_hf_model(single)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    a, _, _ = load_model(single, "auto", CPU, ParallelState())
    b, arch, dtype = load_model(tmp_path, "auto", CPU, ParallelState())
    assert dtype == torch.float32 and arch.qk_norm and arch.head_dim == 32
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_missing_directory_is_a_typed_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope", "auto", CPU, ParallelState())
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path, "auto", CPU, ParallelState())


def test_missing_weights_is_a_typed_error(checkpoint_dir, tmp_path):
    cfg = json.loads((checkpoint_dir("llama") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(tmp_path, "auto", CPU, ParallelState())


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError) as info:
        load_model(tmp_path, "auto", CPU, ParallelState())
    msg = str(info.value)
    assert "GPT2LMHeadModel" in msg
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert name in msg
    assert isinstance(info.value, ModelLoadError)


def test_unsupported_rope_type_is_typed(checkpoint_dir, tmp_path):
    cfg = json.loads((checkpoint_dir("llama") / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_model(tmp_path, "auto", CPU, ParallelState())


def test_dtype_resolution(monkeypatch, caplog):
    cuda = torch.device("cuda")
    caplog.set_level(logging.INFO, logger="pagedserve.workers.loader")
    # auto on the CPU: bf16 stays bf16 exactly where the CPU has bf16 instructions.
    for native, want in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(cpu_caps, "native_bf16_flags", lambda n=native: ("amx_bf16",) * n)
        caplog.clear()
        assert resolve_dtype("auto", "bfloat16", CPU) == want
        (line,) = caplog.messages
        assert f"-> {str(want).removeprefix('torch.')}" in line
        assert ("amx_bf16" in line) == native and ("emulated" in line) != native
        assert resolve_dtype("bfloat16", "float32", CPU) == torch.bfloat16  # explicit wins
        assert resolve_dtype("auto", "float16", CPU) == torch.float32
    assert resolve_dtype("auto", "torch.bfloat16", CPU) == torch.bfloat16
    monkeypatch.undo()
    real = torch.bfloat16 if cpu_caps.has_native_bf16() else torch.float32
    assert resolve_dtype("auto", "bfloat16", CPU) == real  # this machine's own answer
    assert resolve_dtype("auto", "bfloat16", cuda) == torch.bfloat16
    assert resolve_dtype("auto", None, cuda) == torch.float32
    assert resolve_dtype("bfloat16", "float32", CPU) == torch.bfloat16  # explicit wins
    assert resolve_dtype("float16", "bfloat16", cuda) == torch.float16


def test_explicit_half_precision_on_cpu(checkpoint_dir):
    model, _, dtype = load_model(checkpoint_dir("llama"), "bfloat16", CPU, ParallelState())
    assert dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
