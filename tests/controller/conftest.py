"""A deterministic fake executor that behaves like a worker, plus engine factories.

The fake keeps per-request state from the ``SchedulerOutput`` deltas alone (as a real worker
must), simulates the KV pool slot by slot (writes of the whole batch first, then reads, like
the real forward pass) and checks that every position a request attends to holds that
request's token. So prefix hits, copy-on-write and preemption are checked end to end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from helpers.driver import drive

from pagedserve.config import from_flat
from pagedserve.controller.engine_core import EngineCore
from pagedserve.messages import (
    KVCacheLayout,
    LayerKVSpec,
    ModelRunnerOutput,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
    WorkerReport,
    decode,
    encode,
)


def next_token(last: int, seed: int | None, vocab: int) -> int:
    return (last * 31 + 7 + (seed or 0)) % vocab


@dataclass
class _Row:
    tokens: list[int]
    computed: int
    blocks: list[list[int]]
    params: SamplingParams
    emitted: int = 0


@dataclass
class FakeExecutor:
    vocab_size: int = 1000
    max_model_len: int = 256
    num_layers: int = 2
    available_kv_bytes: int = 1 << 20
    check_wire: bool = True
    sliding_window: int | None = None
    """If set, odd layers use this window (a hybrid model: two KV groups)."""
    all_sliding: bool = False
    """With ``sliding_window``: every layer uses the window (one sliding group)."""
    script: dict[str, list[int]] = field(default_factory=dict)
    """Per request id: tokens to emit instead of the arithmetic rule."""

    def __post_init__(self) -> None:
        self.rows: dict[str, _Row] = {}
        self.pool: dict[int, list[int | None]] = {}
        self.host_pool: dict[int, list[int | None]] = {}
        self.outputs: list[SchedulerOutput] = []
        self.layout: KVCacheLayout | None = None
        self.shut = False

    def initialize(self) -> WorkerReport:
        full = LayerKVSpec(num_kv_heads=2, head_size=8, dtype_bytes=2)
        sw = LayerKVSpec(2, 8, 2, sliding_window=self.sliding_window)
        self.layer_specs = [
            sw if self.sliding_window and (i % 2 or self.all_sliding) else full
            for i in range(self.num_layers)
        ]
        return WorkerReport(
            self.layer_specs,
            self.available_kv_bytes,
            self.vocab_size,
            self.max_model_len,
            "cpu",
        )

    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        self.layout = layout

    def shutdown(self) -> None:
        self.shut = True

    def check_failure(self) -> None:
        return None

    def restart(self) -> WorkerReport:
        self.rows.clear()
        self.pool.clear()
        self.host_pool.clear()
        return self.initialize()

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.check_wire:
            raw = encode(so)
            so = decode(raw)
            assert encode(so) == raw, "SchedulerOutput is not stable through the codec"
        self.outputs.append(so)
        assert self.layout is not None
        bs = self.layout.block_size
        for rid in so.finished_req_ids:
            assert rid in self.rows, f"drop of unknown {rid}"
            del self.rows[rid]
        for nr in so.new_reqs:
            assert nr.req_id not in self.rows, f"{nr.req_id} added twice"
            self.rows[nr.req_id] = _Row(
                list(nr.prompt_token_ids) + list(nr.output_token_ids),
                nr.num_computed_tokens,
                [list(g) for g in nr.block_ids],
                nr.sampling_params,
            )
        c = so.cached_reqs
        for i, rid in enumerate(c.req_ids):
            row = self.rows[rid]
            row.tokens.extend(c.new_token_ids[i])
            assert row.computed == c.num_computed_tokens[i], (rid, row.computed, c)
            if c.new_block_ids[i] is not None:
                for g, ids in enumerate(c.new_block_ids[i]):
                    row.blocks[g].extend(ids)
        assert set(so.num_scheduled_tokens) == {nr.req_id for nr in so.new_reqs} | set(c.req_ids)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        # Tier copies first (device -> host, then host -> device), then copy-on-write.
        if so.blocks_to_host or so.blocks_to_device:
            assert self.layout.num_host_blocks > 0, "tier copies without a host tier"
        for src, dst in so.blocks_to_host:
            assert 0 < dst < self.layout.num_host_blocks and 0 < src < self.layout.num_blocks
            self.host_pool[dst] = list(self.pool.get(src, [None] * bs))
        for src, dst in so.blocks_to_device:
            assert 0 < src < self.layout.num_host_blocks and 0 < dst < self.layout.num_blocks
            assert src in self.host_pool, f"host block {src} read before anything was written"
            self.pool[dst] = list(self.host_pool[src])
        for src, dst in so.block_copies:
            self.pool[dst] = list(self.pool.get(src, [None] * bs))
        # Write every scheduled token of the batch, then read: the forward-pass order.
        for rid, n in so.num_scheduled_tokens.items():
            row = self.rows[rid]
            end = row.computed + n
            assert 0 < n and end <= len(row.tokens), (rid, row.computed, n, len(row.tokens))
            for p in range(row.computed, end):
                for g in row.blocks:
                    b = g[p // bs]
                    assert b != 0, "write into the null block"
                    self.pool.setdefault(b, [None] * bs)[p % bs] = row.tokens[p]
        out = ModelRunnerOutput(step_id=so.step_id)
        for rid, n in so.num_scheduled_tokens.items():
            row = self.rows[rid]
            end = row.computed + n
            for g, ids in enumerate(row.blocks):
                window = self.layer_specs[self.layout.groups[g][0]].sliding_window
                # The first token of this chunk attends back to (computed - window, computed].
                first = max(0, end - n - window + 1) if window else 0
                for p in range(first, end):
                    got = self.pool[ids[p // bs]][p % bs]
                    assert got == row.tokens[p], (
                        f"{rid}: KV at {p} holds {got}, not {row.tokens[p]}"
                    )
            row.computed = end
            if end == len(row.tokens):
                script = self.script.get(rid)
                if script is not None:
                    tok = script[row.emitted]
                else:
                    tok = next_token(row.tokens[-1], row.params.seed, self.vocab_size)
                row.emitted += 1
                out.req_ids.append(rid)
                out.sampled_token_ids.append([tok])
        return out


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
    **kwargs: Any,
) -> EngineCore:
    cfg = from_flat(
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
