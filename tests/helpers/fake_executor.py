"""The fake executor the engine-core tests run against: a deterministic stand-in for a worker
group, without a model.

It keeps per-request state from the ``SchedulerOutput`` deltas alone (as a real worker must),
simulates the KV pool slot by slot (writes of the whole batch first, then reads, like the real
forward pass) and checks that every position a request attends to holds that request's token.
So prefix hits, copy-on-write, tier copies and preemption are checked end to end. Each
request's next token depends on its own last token (and seed) only, so what it produces is the
same whatever it is batched with and whether it was preempted. Faults on cue: ``fail`` (one
step raises), ``restart_failures``, ``reject`` (a new request the worker cannot take);
subclasses override ``execute`` or ``sample`` for others. With ``overlaps_steps`` the engine
may submit a step before it collects the one before (async scheduling): steps then run in
order at ``collect``, and placeholder tokens take the row's last sample, as a worker's do.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.messages import (
    PLACEHOLDER_TOKEN,
    KVCacheLayout,
    LayerKVSpec,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
    WorkerReport,
    decode,
    encode,
)

__all__ = ["FakeExecutor", "Row", "next_token"]


def next_token(last: int, seed: int | None, vocab: int) -> int:
    return (last * 31 + 7 + (seed or 0)) % vocab


@dataclass
class Row:
    """What the fake worker knows of one request, from the deltas alone."""

    tokens: list[int]
    computed: int
    blocks: list[list[int]]
    params: SamplingParams
    prompt_len: int
    emitted: int = 0
    last_sampled: int | None = None


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
    rule: Callable[[int, int | None, int], int] = next_token
    """The arithmetic rule: ``(last token, seed, vocab size) -> next token``."""
    step_s: float = 0.0
    """Each step takes this long, as a real one takes time (so an abort can land mid-request)."""
    fail: BaseException | None = None
    """Raised once, by the first step whose id is at least ``fail_at_step`` (a worker group
    that died: ``WorkerGroupError``; any other error kills the engine)."""
    fail_at_step: int = 0
    restart_failures: int = 0
    """How many ``restart`` calls fail (a placement group that is not ready) before one works."""
    reject: Callable[[NewRequestData], str | None] | None = None
    """A new request for which this returns an error is rejected as a worker rejects one it
    cannot take: not added, nothing of it computed, the error in ``request_errors``. In this
    mode a read of KV that does not hold the reader's token is recorded in ``bad_reads`` (and
    samples ``vocab_size - 1``) instead of failing the step: what a real worker would do."""
    overlaps_steps: bool = False
    """Offer ``submit``/``collect``: the engine may schedule a step while one is in flight."""

    def __post_init__(self) -> None:
        self.rows: dict[str, Row] = {}
        self.pool: dict[int, list[int | None]] = {}
        self.host_pool: dict[int, list[int | None]] = {}
        self.outputs: list[SchedulerOutput] = []
        self.layout: KVCacheLayout | None = None
        self.shut = False
        self.restarts = 0
        self.restart_times: list[float] = []
        self.rejected: set[str] = set()
        self.bad_reads: list[tuple[str, int]] = []
        self.submitted: deque[SchedulerOutput] = deque()
        self.max_in_flight = 0

    def submit(self, so: SchedulerOutput) -> None:
        assert self.overlaps_steps, "submit() on an executor that does not overlap steps"
        self.submitted.append(so)
        self.max_in_flight = max(self.max_in_flight, len(self.submitted))

    def collect(self) -> ModelRunnerOutput:
        return self.execute(self.submitted.popleft())

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

    load_model = initialize  # so that it also stands in for a worker under ``LocalExecutor``

    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        self.layout = layout

    def shutdown(self) -> None:
        self.shut = True

    def check_failure(self) -> None:
        return None

    def restart(self) -> WorkerReport:
        self.restart_times.append(time.monotonic())
        if self.restart_failures:
            self.restart_failures -= 1
            raise RuntimeError("placement group not ready")
        self.restarts += 1
        self.submitted.clear()
        self.rows.clear()
        self.pool.clear()
        self.host_pool.clear()
        return self.initialize()

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.fail is not None and so.step_id >= self.fail_at_step:
            exc, self.fail = self.fail, None
            raise exc
        time.sleep(self.step_s)
        if self.check_wire:
            raw = encode(so)
            so = decode(raw)
            assert encode(so) == raw, "SchedulerOutput is not stable through the codec"
        self.outputs.append(so)
        assert self.layout is not None
        bs = self.layout.block_size
        for rid in so.finished_req_ids:
            assert rid in self.rows or rid in self.rejected, f"drop of unknown {rid}"
            self.rows.pop(rid, None)
        errors: dict[str, str] = {}
        for nr in so.new_reqs:
            assert nr.req_id not in self.rows, f"{nr.req_id} added twice"
            assert PLACEHOLDER_TOKEN not in nr.output_token_ids, f"{nr.req_id}: placeholder"
            error = self.reject(nr) if self.reject is not None else None
            if error is not None:
                errors[nr.req_id] = error
                self.rejected.add(nr.req_id)
                continue
            self.rows[nr.req_id] = Row(
                list(nr.prompt_token_ids) + list(nr.output_token_ids),
                nr.num_computed_tokens,
                [list(g) for g in nr.block_ids],
                nr.sampling_params,
                len(nr.prompt_token_ids),
                # A resumed request (preempted, or carried over a failure) continues its script.
                emitted=len(nr.output_token_ids),
            )
        c = so.cached_reqs
        for i, rid in enumerate(c.req_ids):
            row = self.rows[rid]
            new = c.new_token_ids[i]
            if PLACEHOLDER_TOKEN in new:
                assert self.overlaps_steps and row.last_sampled is not None, (rid, new)
                new = [row.last_sampled if t == PLACEHOLDER_TOKEN else t for t in new]
            row.tokens.extend(new)
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
        scheduled = {r: n for r, n in so.num_scheduled_tokens.items() if r not in errors}
        for rid, n in scheduled.items():
            row = self.rows[rid]
            end = row.computed + n
            assert 0 < n and end <= len(row.tokens), (rid, row.computed, n, len(row.tokens))
            self._write(row, row.computed, end)
        out = ModelRunnerOutput(step_id=so.step_id, request_errors=errors)
        for rid, n in scheduled.items():
            row = self.rows[rid]
            end = row.computed + n
            bad = self._read(rid, row, end, n)
            row.computed = end
            if end == len(row.tokens):
                tok = self.vocab_size - 1 if bad else self.sample(rid, row)
                row.emitted += 1
                row.last_sampled = tok
                out.req_ids.append(rid)
                out.sampled_token_ids.append([tok])
                if so.num_decode_steps > 1:
                    self._decode_more(rid, row, out.sampled_token_ids[-1], so.num_decode_steps)
        return out

    def _write(self, row: Row, start: int, end: int) -> None:
        """The KV of the row's positions [start, end), in every group."""
        assert self.layout is not None
        bs = self.layout.block_size
        for p in range(start, end):
            for g in row.blocks:
                b = g[p // bs]
                assert b != 0, "write into the null block"
                self.pool.setdefault(b, [None] * bs)[p % bs] = row.tokens[p]

    def _read(self, rid: str, row: Row, end: int, n: int) -> bool:
        """Check every position the row's last ``n`` tokens (up to ``end``) attend to; True
        where one held another token (recorded in ``bad_reads`` in ``reject`` mode, else an
        assertion fails)."""
        assert self.layout is not None
        bs, bad = self.layout.block_size, False
        for g, ids in enumerate(row.blocks):
            window = self.layer_specs[self.layout.groups[g][0]].sliding_window
            # The first token of this chunk attends back to (computed - window, computed].
            first = max(0, end - n - window + 1) if window else 0
            for p in range(first, end):
                got = self.pool.get(ids[p // bs], [None] * bs)[p % bs]
                if got != row.tokens[p] and self.reject is not None:
                    self.bad_reads.append((rid, p))
                    bad = True
                    continue
                assert got == row.tokens[p], f"{rid}: KV at {p} holds {got}, not {row.tokens[p]}"
        return bad

    def _decode_more(self, rid: str, row: Row, tokens: list[int], steps: int) -> None:
        """More decode passes, as ``workers/multi_step.py`` runs them: each feeds the last
        sample (its KV written into a lookahead slot, then every position it attends to
        checked) until the row's room or a stop token ends them. The samples are not kept
        as the row's tokens: the next step's delta appends them."""
        assert self.layout is not None
        bs, n0, p = self.layout.block_size, len(row.tokens), row.params
        slots = min(len(g) for g in row.blocks) * bs
        total = min(steps, self.max_model_len - n0, slots + 1 - n0)
        if p.max_tokens is not None:
            total = min(total, p.max_tokens - (n0 - row.prompt_len))

        def stops(tok: int) -> bool:
            return len(row.tokens) + 1 - row.prompt_len > p.min_tokens and (
                tok in p.stop_token_ids)

        script = self.script.get(rid)
        while len(tokens) < total and not stops(tokens[-1]) and (
                script is None or row.emitted < len(script)):
            row.tokens.append(tokens[-1])
            self._write(row, len(row.tokens) - 1, len(row.tokens))
            bad = self._read(rid, row, len(row.tokens), 1)
            tokens.append(self.vocab_size - 1 if bad else self.sample(rid, row))
            row.emitted += 1
        del row.tokens[n0:]
        row.computed = n0 + len(tokens) - 1
        row.last_sampled = tokens[-1]

    def sample(self, rid: str, row: Row) -> int:
        """The token a request whose scheduled tokens reach its end samples this step."""
        script = self.script.get(rid)
        if script is not None:
            return script[row.emitted]
        return self.rule(row.tokens[-1], row.params.seed, self.vocab_size)
