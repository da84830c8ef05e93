"""The start-up warm-up: the lazy work of a first step is done inside ``init_kv_cache``, and it
leaves nothing behind that a real request could see."""

from __future__ import annotations

import torch
from helpers.stepper import layout_for

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.kernels.cpu import cpu_ops
from pagedserve.messages import KVCacheLayout, ModelRunnerOutput
from pagedserve.workers import warmup
from pagedserve.workers.model_runner import ModelRunner
from pagedserve.workers.worker import Worker


def test_init_kv_cache_runs_a_prefill_and_a_decode_step_and_leaves_no_trace(
    checkpoint_dir, monkeypatch
) -> None:
    steps: list[tuple[int, dict[str, int], list[str]]] = []
    execute = ModelRunner.execute

    def recording(self: ModelRunner, so) -> ModelRunnerOutput:  # type: ignore[no-untyped-def]
        steps.append((so.step_id, dict(so.num_scheduled_tokens), list(so.finished_req_ids)))
        return execute(self, so)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    hybrid = checkpoint_dir("hybrid")  # a sliding-window group beside a full-attention one
    w = Worker(EngineConfig(
        model=ModelConfig(model=str(hybrid), dtype="float32"),
        cache=CacheConfig(block_size=4, kv_cache_memory_bytes=1 << 22),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
    ))
    report = w.load_model()
    layout = layout_for(report, num_blocks=16, block_size=4)
    assert len(layout.groups) == 2
    w.init_kv_cache(layout)

    n = warmup.WARMUP_PROMPT_TOKENS
    ids = ["__warmup_0__", "__warmup_1__"]
    assert steps == [
        (-3, dict.fromkeys(ids, n), []),
        (-2, dict.fromkeys(ids, 1), []),
        (-1, {}, ids),
    ]
    assert w.runner is not None and w.runner.batch.num_reqs == 0
    # Unseeded sampling draws from where a fresh generator of the model's seed would.
    fresh = torch.Generator().manual_seed(w.config.model.seed)
    assert torch.equal(w.runner.sampler.generator.get_state(), fresh.get_state())
    for tensor in w.runner.kv_pool.tensors:  # the whole pool as fresh as allocated
        assert torch.count_nonzero(tensor) == 0
    if not torch.cuda.is_available():
        assert cpu_ops.cache_info().currsize == 1  # the compiled kernels are loaded already


def test_a_short_context_caps_the_warm_up_prompt(checkpoint_dir, monkeypatch) -> None:
    lens: list[int] = []
    execute = ModelRunner.execute

    def recording(self: ModelRunner, so) -> ModelRunnerOutput:  # type: ignore[no-untyped-def]
        lens.extend(len(r.prompt_token_ids) for r in so.new_reqs)
        return execute(self, so)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    w = Worker(EngineConfig(
        model=ModelConfig(model=str(checkpoint_dir("llama")), dtype="float32", max_model_len=8),
        cache=CacheConfig(block_size=4, kv_cache_memory_bytes=1 << 22),
        scheduler=SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2),
    ))
    report = w.load_model()
    w.init_kv_cache(KVCacheLayout(8, 4, [list(range(len(report.layer_specs)))]))
    assert lens == [7, 7]



def test_a_one_row_batch_warms_up_one_request_at_a_time(checkpoint_dir, monkeypatch) -> None:
    rows: list[int] = []
    execute = ModelRunner.execute

    def recording(self: ModelRunner, so) -> ModelRunnerOutput:  # type: ignore[no-untyped-def]
        rows.append(len(so.num_scheduled_tokens))
        return execute(self, so)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    w = Worker(EngineConfig(
        model=ModelConfig(model=str(checkpoint_dir("llama")), dtype="float32"),
        cache=CacheConfig(block_size=4, kv_cache_memory_bytes=1 << 22),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1),
    ))
    report = w.load_model()
    w.init_kv_cache(KVCacheLayout(16, 4, [list(range(len(report.layer_specs)))]))
    assert rows == [1, 1, 0, 1, 1, 0]
    assert w.runner is not None and w.runner.batch.num_reqs == 0
