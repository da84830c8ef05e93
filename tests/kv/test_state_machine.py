"""Random admit / decode / chunked prefill / free / fork / preempt / prefix-hit sequences.

Invariants are checked after every step; an ``allocate_slots`` that returns None must leave
the manager bit-for-bit unchanged; freeing every request must return every usable block.
"""

from __future__ import annotations

from helpers.kv_requests import SimpleRequest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagedserve.kv import (
    BlockHasher,
    FullAttentionSpec,
    KVCacheManager,
    SlidingWindowSpec,
)

B = 4
MAX_LEN = 96
PREFIXES = [[1] * 12, [2, 3] * 6, list(range(20, 32))]

CONFIGS = {
    "full": dict(specs=[FullAttentionSpec(B, 1, 1, 1)], caching=True, policy="paged"),
    "nocache": dict(specs=[FullAttentionSpec(B, 1, 1, 1)], caching=False, policy="paged"),
    "hybrid": dict(
        specs=[FullAttentionSpec(B, 1, 1, 1), SlidingWindowSpec(B, 1, 1, 1, sliding_window=8)],
        caching=True,
        policy="paged",
    ),
    "sliding": dict(
        specs=[SlidingWindowSpec(B, 1, 1, 1, sliding_window=10)], caching=True, policy="paged"
    ),
    "reserve": dict(specs=[FullAttentionSpec(B, 1, 1, 1)], caching=True, policy="reserve"),
}


def snapshot(m: KVCacheManager):  # type: ignore[no-untyped-def]
    return (
        [b.block_id for b in m.pool.free_block_queue],
        [(b.ref_cnt, b.block_hash) for b in m.pool.blocks],
        {k: (type(v), getattr(v, "block_id", None) or sorted(v)) for k, v in m.pool.cached.items()},
        [{r: [b.block_id for b in bl] for r, bl in g.req_to_blocks.items()} for g in m.managers],
        [dict(g.num_cached_blocks) for g in m.managers],
        dict(m._num_filled),
        list(m._pending_copies),
    )


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager | None = None
        self.running: list[SimpleRequest] = []
        self.waiting: list[SimpleRequest] = []
        self.counter = 0

    @initialize(
        config=st.sampled_from(sorted(CONFIGS)),
        num_blocks=st.integers(8, 40),
    )
    def setup(self, config: str, num_blocks: int) -> None:
        c = CONFIGS[config]
        if c["policy"] == "reserve":
            num_blocks = max(num_blocks, 1 + MAX_LEN // B)
        self.m = KVCacheManager(
            c["specs"], num_blocks, B, MAX_LEN, enable_caching=c["caching"], policy=c["policy"]
        )
        self.hasher = BlockHasher(B)

    # ------------------------------------------------------------------ helpers
    def _try_alloc(
        self,
        r: SimpleRequest,
        n: int,
        hit: int = 0,
        hit_blocks=None,  # type: ignore[no-untyped-def]
    ) -> bool:
        m = self.m
        assert m is not None
        before = snapshot(m)
        out = m.allocate_slots(r, n, hit, hit_blocks)
        if out is None:
            assert snapshot(m) == before, "allocate_slots returned None but changed state"
            return False
        return True

    def _admit(self, r: SimpleRequest, chunk: int) -> None:
        m = self.m
        assert m is not None
        hit_blocks, hit = m.get_computed_blocks(r)
        assert hit % m.block_size == 0 and hit <= max(r.num_tokens - 1, 0)
        # Hit blocks are exactly the blocks cached under the request's own hashes.
        for gid, blocks in enumerate(hit_blocks.blocks):
            for i, b in enumerate(blocks):
                if not b.is_null:
                    assert b.block_hash is not None
                    assert b.block_hash[:-4] == r.block_hashes[i]
                    assert int.from_bytes(b.block_hash[-4:], "big") == gid
        n = min(r.num_tokens - hit, chunk)
        if self._try_alloc(r, n, hit, hit_blocks):
            r.num_computed_tokens = hit + n
            self.running.append(r)
        else:
            self.waiting.append(r)

    # -------------------------------------------------------------------- rules
    @rule(
        family=st.integers(0, len(PREFIXES)),
        tail=st.lists(st.integers(0, 5), max_size=20),
        chunk=st.integers(1, 40),
        salt=st.sampled_from([None, None, "t1"]),
    )
    def admit(self, family: int, tail: list[int], chunk: int, salt: str | None) -> None:
        prompt = (PREFIXES[family] if family < len(PREFIXES) else []) + tail
        if not prompt:
            prompt = [9]
        self.counter += 1
        r = SimpleRequest(f"r{self.counter}", prompt, self.hasher, salt)
        self._admit(r, chunk)

    @precondition(lambda self: self.waiting)
    @rule(idx=st.integers(0, 100), chunk=st.integers(1, 40))
    def readmit(self, idx: int, chunk: int) -> None:
        r = self.waiting.pop(idx % len(self.waiting))
        self._admit(r, chunk)

    @precondition(lambda self: self.running)
    @rule(
        idx=st.integers(0, 100),
        chunk=st.integers(1, 40),
        token=st.integers(0, 5),
    )
    def step(self, idx: int, chunk: int, token: int) -> None:
        """Continue a chunked prefill, or sample one token and decode it."""
        r = self.running[idx % len(self.running)]
        if r.num_computed_tokens == r.num_tokens:
            if r.num_tokens >= MAX_LEN:
                return self._finish(r)
            r.append_token_id(token)
        n = min(r.num_tokens - r.num_computed_tokens, chunk)
        if self._try_alloc(r, n):
            r.num_computed_tokens += n

    @precondition(lambda self: self.running)
    @rule(idx=st.integers(0, 100))
    def finish(self, idx: int) -> None:
        self._finish(self.running[idx % len(self.running)])

    def _finish(self, r: SimpleRequest) -> None:
        assert self.m is not None
        self.m.free(r)
        self.running.remove(r)

    @precondition(lambda self: self.running)
    @rule()
    def preempt_newest(self) -> None:
        assert self.m is not None
        r = self.running.pop()
        self.m.free(r)
        r.num_computed_tokens = 0
        self.waiting.insert(0, r)

    @precondition(lambda self: self.running)
    @rule(idx=st.integers(0, 100))
    def fork(self, idx: int) -> None:
        assert self.m is not None
        parent = self.running[idx % len(self.running)]
        self.counter += 1
        child = parent.fork(f"r{self.counter}")
        self.m.fork(parent, child)
        self.running.append(child)

    @rule()
    def drain_copies(self) -> None:
        assert self.m is not None
        copies = self.m.take_pending_copies()
        reps = self.m.take_block_replacements()
        assert len(copies) == len(reps)
        for (src, dst), (_, _, _, new_id) in zip(copies, reps, strict=True):
            assert dst == new_id and src != dst

    # --------------------------------------------------------------- invariants
    @invariant()
    def integrity(self) -> None:
        if self.m is None:
            return
        self.m.check_integrity()
        usage = self.m.usage
        assert 0.0 <= usage <= 1.0
        if self.m.policy == "reserve":
            per = -(-MAX_LEN // B)
            for r in self.running:
                assert len(self.m.get_block_ids(r.request_id)[0]) == per
        fill = self.m.block_fill_snapshot()
        assert fill[0] == 0 and fill.max(initial=0) <= B

    def teardown(self) -> None:
        if self.m is None:
            return
        for r in list(self.running):
            self._finish(r)
        self.m.check_integrity()
        assert self.m.num_free_blocks == self.m.pool.num_blocks - 1
        assert self.m.usage == 0.0


KVMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVStateMachine = KVMachine.TestCase
