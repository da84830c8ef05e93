"""Engine factories over the fake executor (``helpers/fake_executor.py``), for the engine-core
tests."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from helpers.driver import drive
from helpers.fake_executor import FakeExecutor, next_token

from pagedserve.config import from_flat
from pagedserve.controller.engine_core import EngineCore
from pagedserve.messages import RequestOutput


def make_engine(
    *,
    block_size: int = 4,
    num_gpu_blocks: int | None = 64,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int | None = None,
    enable_prefix_caching: bool = True,
    allocation_policy: str = "paged",
    executor: FakeExecutor | None = None,
    max_pending_requests: int = 4096,
    num_host_blocks: int | None = None,
    preemption_mode: str = "recompute",
    kv_offload: bool = True,
    scheduling_policy: str = "fcfs",
    num_scheduler_steps: int = 1,
    **kwargs: Any,
) -> EngineCore:
    """One decode pass per step unless asked: most tests here follow a request token by
    token."""
    cfg = from_flat(
        num_scheduler_steps=num_scheduler_steps,
        scheduling_policy=scheduling_policy,
        num_host_blocks=num_host_blocks,
        preemption_mode=preemption_mode,
        kv_offload=kv_offload,
        max_pending_requests=max_pending_requests,
        allocation_policy=allocation_policy,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
    )
    return drive(EngineCore(cfg, executor or FakeExecutor(), **kwargs))


def run_to_completion(engine: EngineCore, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    done: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.kv.check_integrity()
    assert not engine.has_unfinished(), "engine did not finish"
    return done


def assert_idle(engine: EngineCore) -> None:
    engine.kv.check_integrity()
    assert engine.kv.usage == 0.0
    host = engine.kv.host
    if host is not None:  # 0 leaked blocks in the host tier too
        assert host.num_free_blocks == host.num_usable_blocks and not host.swapped
        assert host.pending == ([], []) and not host.held_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.scheduler.requests
    assert not engine.has_unfinished()


@pytest.fixture
def kit() -> SimpleNamespace:
    """The helpers above (test modules cannot import conftest under importlib mode)."""
    return SimpleNamespace(
        FakeExecutor=FakeExecutor,
        make_engine=make_engine,
        run=run_to_completion,
        assert_idle=assert_idle,
        next_token=next_token,
    )


@pytest.fixture(scope="session")
def byte_tokenizer():
    """A byte-level BPE tokenizer built in memory: multi-byte characters span several tokens."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pagedserve.controller.tokenizer import Tokenizer

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    raw.train_from_iterator(["hello world, the end. STOP here"] * 4, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>")
    return Tokenizer(hf)
