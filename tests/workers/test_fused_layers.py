"""The compiled whole-layer path (``kernels.decoder_layer``) computes exactly what the modules
compute: the same workload, chunked prefills beside decodes, through a worker whose layers take
the call and through the same worker with it switched off, gives bit-identical prompt
log-probabilities and the same greedy tokens, in float32 and bfloat16, over a KV cache of the
model's dtype or of its own (bf16, scaled fp8). Layers it does not carry (Qwen3's q/k norms) keep
the modules."""

from __future__ import annotations

import random

import pytest

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.kernels.cpu import cpu_ops
from pagedserve.messages import SamplingParams
from pagedserve.workers.models import fused_layers
from pagedserve.workers.worker import Worker

B = 4

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="no compiled CPU kernels")


def _run(path, dtype: str, stepper_module, fused: bool, calls: list[int], **cache):
    w = Worker(EngineConfig(
        model=ModelConfig(model=str(path), dtype=dtype),
        cache=CacheConfig(block_size=B, kv_cache_memory_bytes=1 << 24, **cache),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
    ))
    layout = stepper_module.layout_for(w.load_model(), num_blocks=160, block_size=B)
    taken = w.model.model.fuse_layers()
    if not fused:
        w.model.model.fused = [None] * len(w.model.model.layers)
    w.init_kv_cache(layout)
    rng = random.Random(5)
    st = stepper_module.Stepper(w, layout, seed=3)
    before = len(calls)
    for i in range(4):
        prompt = [1] + [rng.randrange(3, 512) for _ in range(rng.randrange(3, 30))]
        st.add(f"r{i}", prompt, 12,
               SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=0))
    tokens = st.run(budget=24)  # chunks of up to 24 tokens beside decodes
    logprobs = {rid: lps for out in st.outputs
                for rid, (_first, _ids, lps) in (out.prompt_logprobs or {}).items()}
    w.shutdown()
    return taken, tokens, logprobs, len(calls) - before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_the_compiled_layer_equals_the_modules(kind, dtype, checkpoint_dir, stepper_module,
                                               monkeypatch) -> None:
    calls: list[int] = []
    real = fused_layers.decoder_layer

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_layers, "decoder_layer", counted)
    path = checkpoint_dir(kind)
    n, want_tokens, want_lps, off_calls = _run(path, dtype, stepper_module, False, calls)
    taken, got_tokens, got_lps, on_calls = _run(path, dtype, stepper_module, True, calls)
    assert taken == n == 2  # every layer of these checkpoints qualifies
    assert off_calls == 0 and on_calls > 0
    assert got_tokens == want_tokens
    assert got_lps.keys() == want_lps.keys()
    for rid, lps in want_lps.items():
        assert got_lps[rid] == lps, rid  # bit for bit: the same operators in the same order


# (model dtype, KV cache options): bf16 under float32, fp8 at scale 1 and with calibrated scales.
KV_CASES = [("float32", {"kv_cache_dtype": "bfloat16"}),
            ("float32", {"kv_cache_dtype": "fp8_e4m3"}),
            ("bfloat16", {"kv_cache_dtype": "fp8_e4m3", "calculate_kv_scales": True})]


@pytest.mark.parametrize("dtype,cache", KV_CASES)
def test_a_narrow_kv_cache_takes_the_call_and_equals_the_modules(dtype, cache, checkpoint_dir,
                                                                  stepper_module, monkeypatch):
    calls: list[int] = []
    real = fused_layers.decoder_layer
    monkeypatch.setattr(fused_layers, "decoder_layer",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    path = checkpoint_dir("llama")
    _, want_tokens, want_lps, off_calls = _run(path, dtype, stepper_module, False, calls, **cache)
    _, got_tokens, got_lps, on_calls = _run(path, dtype, stepper_module, True, calls, **cache)
    assert off_calls == 0 and on_calls > 0
    assert got_tokens == want_tokens and got_lps == want_lps


def test_layers_it_does_not_carry_keep_the_modules(checkpoint_dir, stepper_module) -> None:
    w = Worker(EngineConfig(model=ModelConfig(model=str(checkpoint_dir("qwen3")))))
    w.load_model()
    assert w.model.model.fuse_layers() == 0
    assert all(f is None for f in w.model.model.fused)
    w.shutdown()


def test_float32_prefill_takes_the_call(checkpoint_dir, stepper_module, monkeypatch) -> None:
    """A float32 step with a 40-token prefill takes the call in every layer, as a decode
    step does."""
    calls: list[int] = []
    real = fused_layers.decoder_layer
    monkeypatch.setattr(fused_layers, "decoder_layer",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    w = Worker(EngineConfig(
        model=ModelConfig(model=str(checkpoint_dir("llama")), dtype="float32"),
        cache=CacheConfig(block_size=B, kv_cache_memory_bytes=1 << 24),
    ))
    layout = stepper_module.layout_for(w.load_model(), num_blocks=160, block_size=B)
    w.init_kv_cache(layout)  # its warm-up steps took the call too
    assert w.model.model.fuse_layers() == 2
    calls.clear()
    st = stepper_module.Stepper(w, layout, seed=3)
    st.add("long", list(range(3, 43)), 1, SamplingParams(temperature=0.0, max_tokens=1))
    st.run(budget=64)  # one 40-token prefill step, no decode
    assert len(calls) == 2
    st.add("short", list(range(3, 10)), 2, SamplingParams(temperature=0.0, max_tokens=2))
    st.run(budget=64)  # a 7-token prefill, then a decode
    assert len(calls) == 2 + 2 * 2
    w.shutdown()
