"""The demo checkpoint: deterministic bytes, loads in transformers, and our greedy matches."""

from __future__ import annotations

import hashlib

import pytest

from pagedserve.workers.demo import demo_checkpoint_dir, write_demo_checkpoint


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo"))


def _digest(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_deterministic_and_complete(demo, tmp_path):
    again = write_demo_checkpoint(tmp_path / "again")
    assert _digest(demo) == _digest(again)
    assert set(_digest(demo)) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_transformers_loads_model_and_tokenizer(demo):
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(demo)
    assert len(tok) == 512 and tok.bos_token_id == 1 and tok.eos_token_id == 2
    text = "Hello, world! The quick brown fox: 42 + 7 = 49 ünïcödé ✓"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|assistant|>\n") and "hi" in chat
    model = tf.AutoModelForCausalLM.from_pretrained(demo)
    assert model.config.num_hidden_layers == 4 and model.config.vocab_size == 512


def test_worker_matches_transformers_on_demo(demo, checkpoints, stepper_module):
    import torch

    from pagedserve.config import CacheConfig, EngineConfig, ModelConfig
    from pagedserve.workers.worker import Worker

    worker = Worker(
        EngineConfig(
            # float32 pinned: the reference is greedy token for token, whatever "auto" picks here
            model=ModelConfig(model=str(demo), dtype="float32"),
            cache=CacheConfig(block_size=16, kv_cache_memory_bytes=1 << 24),
        )
    )
    report = worker.load_model()
    assert worker.dtype == torch.float32 and report.layer_specs[0].dtype_bytes == 4
    layout = stepper_module.layout_for(report, num_blocks=32, block_size=16)
    worker.init_kv_cache(layout)
    st = stepper_module.Stepper(worker, layout)
    prompt = [1, 400, 434, 14, 507, 340, 3, 353, 393, 389, 16]
    st.add("a", prompt, 8)
    ours = st.run()["a"]
    hf = checkpoints.load_hf_model(demo)
    assert ours == checkpoints.hf_greedy(hf, prompt, 8)


def test_demo_dir_written_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = demo_checkpoint_dir()
    assert first == tmp_path / "pagedserve" / "demo-model"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert demo_checkpoint_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
