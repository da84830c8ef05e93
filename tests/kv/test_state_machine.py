"""Random admit / decode / chunked prefill / free / fork / preempt / prefix-hit sequences,
with and without a host tier (swap preemption, swap-in, evicted blocks kept on the host and
hit there), and with lookahead slots (speculative decoding) on admissions and steps, and
speculative verification (drafts scheduled, a random number accepted, the blocks only
rejected drafts filled given back).

Invariants are checked after every step, for both tiers; an ``allocate_slots`` or ``swap_in``
that returns None must leave the manager bit-for-bit unchanged; an allocation leaves each
group exactly the blocks its tokens and lookahead slots need (lookahead left from an earlier
step is re-used, never grown past); no block hash covers a slot the request has not written
a real token into; freeing every request must return every usable block of either tier.
With a host tier the machine ships the tier copies (a step boundary) before it frees a
request, as the scheduler does: a block is never freed in the step that allocated it.
"""

from __future__ import annotations

import os

from helpers.kv_requests import SimpleRequest
from helpers.kv_state import check_hashes_cover_real_tokens, snapshot
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
# Mostly none; up to past MAX_LEN from any position (capped there).
LOOKAHEAD = st.sampled_from([0, 0, 0]) | st.integers(1, 9) | st.just(MAX_LEN)

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
    "full+host": dict(specs=[FullAttentionSpec(B, 1, 1, 1)], caching=True, policy="paged",
                      host=True),
    "nocache+host": dict(specs=[FullAttentionSpec(B, 1, 1, 1)], caching=False, policy="paged",
                         host=True),
    "hybrid+host": dict(
        specs=[FullAttentionSpec(B, 1, 1, 1), SlidingWindowSpec(B, 1, 1, 1, sliding_window=8)],
        caching=True,
        policy="paged",
        host=True,
    ),
}


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager | None = None
        self.running: list[SimpleRequest] = []
        self.waiting: list[SimpleRequest] = []
        self.counter = 0
        self.touched: set[str] = set()  # allocated since the tier copies were last shipped

    @initialize(
        config=st.sampled_from(sorted(CONFIGS)),
        num_blocks=st.integers(8, 40),
        num_host=st.integers(2, 30),
    )
    def setup(self, config: str, num_blocks: int, num_host: int) -> None:
        c = CONFIGS[config]
        if c["policy"] == "reserve":
            num_blocks = max(num_blocks, 1 + MAX_LEN // B)
        self.m = KVCacheManager(
            c["specs"], num_blocks, B, MAX_LEN, enable_caching=c["caching"], policy=c["policy"],
            num_host_blocks=num_host if c.get("host") else 0,
        )
        self.hasher = BlockHasher(B)

    # ------------------------------------------------------------------ helpers
    def _try_alloc(
        self,
        r: SimpleRequest,
        n: int,
        hit: int = 0,
        hit_blocks=None,  # type: ignore[no-untyped-def]
        lookahead: int = 0,
    ) -> bool:
        m = self.m
        assert m is not None
        rid = r.request_id
        had = [len(g.req_to_blocks.get(rid, ())) for g in m.managers]
        before = snapshot(m)
        out = m.allocate_slots(r, n, hit, hit_blocks, lookahead)
        if out is None:
            assert snapshot(m) == before, "allocate_slots returned None but changed state"
            return False
        # Blocks for every token and lookahead slot (capped at MAX_LEN), the reservation of a
        # new request under ``reserve``; never more than that or than the request held.
        slots = min(r.num_computed_tokens + hit + n + lookahead, MAX_LEN)
        if m.policy == "reserve" and not any(had):
            slots = MAX_LEN
        # Every block the step may write, lookahead slots included, is the request's alone.
        first = (r.num_computed_tokens + hit) // B
        for g, n_had in zip(m.managers, had, strict=True):
            blocks = g.req_to_blocks[rid]
            assert len(blocks) == max(n_had, -(-slots // B))
            assert all(b.ref_cnt == 1 for b in blocks[first : -(-slots // B)] if not b.is_null)
        self.touched.add(rid)
        return True

    def _ship(self) -> None:
        """A step boundary: the step's tier copies go to the workers."""
        m = self.m
        assert m is not None
        to_host, to_device = m.take_tier_copies()
        for pairs in (to_host, to_device):
            dsts = [d for _, d in pairs]
            assert len(set(dsts)) == len(dsts) and 0 not in dsts
            assert all(s != 0 for s, _ in pairs)
        self.touched.clear()

    def _admit(self, r: SimpleRequest, chunk: int, lookahead: int = 0) -> None:
        m = self.m
        assert m is not None
        if m.is_swapped(r.request_id):
            if r.num_computed_tokens == r.num_tokens:
                r.append_token_id(0)  # swapped right after sampling: the new token is next
            n = min(r.num_tokens - r.num_computed_tokens, chunk)
            before = snapshot(m)
            if m.swap_in(r, n) is None:
                assert snapshot(m) == before, "swap_in returned None but changed state"
                self.waiting.append(r)
            else:
                r.num_computed_tokens += n
                self.touched.add(r.request_id)
                self.running.append(r)
            return
        hit_blocks, hit = m.get_computed_blocks(r)
        assert hit % m.block_size == 0 and hit <= max(r.num_tokens - 1, 0)
        # Hit blocks are exactly the blocks cached under the request's own hashes.
        for gid, blocks in enumerate(hit_blocks.blocks):
            for i, b in enumerate(blocks):
                if not b.is_null:
                    assert b.block_hash is not None
                    assert b.block_hash[:-4] == r.block_hashes[i]
                    assert int.from_bytes(b.block_hash[-4:], "big") == gid
        for i, b in enumerate(hit_blocks.host, len(hit_blocks.blocks[0])):
            assert b.block_hash == r.block_hashes[i] + (0).to_bytes(4, "big")
        n = min(r.num_tokens - hit, chunk)
        if self._try_alloc(r, n, hit, hit_blocks, lookahead):
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
        lookahead=LOOKAHEAD,
    )
    def admit(
        self, family: int, tail: list[int], chunk: int, salt: str | None, lookahead: int
    ) -> None:
        prompt = (PREFIXES[family] if family < len(PREFIXES) else []) + tail
        if not prompt:
            prompt = [9]
        self.counter += 1
        r = SimpleRequest(f"r{self.counter}", prompt, self.hasher, salt)
        self._admit(r, chunk, lookahead)

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
        lookahead=LOOKAHEAD,
    )
    def step(self, idx: int, chunk: int, token: int, lookahead: int) -> None:
        """Continue a chunked prefill, or sample one token and decode it, with room for
        ``lookahead`` draft tokens."""
        r = self.running[idx % len(self.running)]
        if r.request_id in self.touched:
            self._ship()  # a request is scheduled once per step: this is the next step
        if r.num_computed_tokens == r.num_tokens:
            if r.num_tokens >= MAX_LEN:
                return self._finish(r)
            r.append_token_id(token)
        n = min(r.num_tokens - r.num_computed_tokens, chunk)
        if self._try_alloc(r, n, lookahead=lookahead):
            r.num_computed_tokens += n

    @precondition(lambda self: self.running)
    @rule(
        idx=st.integers(0, 100),
        token=st.integers(0, 5),
        drafts=st.lists(st.integers(0, 5), min_size=1, max_size=9),
        accept=st.integers(0, 9),
    )
    def verify(self, idx: int, token: int, drafts: list[int], accept: int) -> None:
        """A speculative step: a decoding request computes its last token and ``drafts``
        after it, accepts the first ``accept`` of them plus one token of its own, and gives
        back the blocks only rejected drafts filled."""
        m = self.m
        assert m is not None
        r = self.running[idx % len(self.running)]
        if r.request_id in self.touched:
            self._ship()
        if r.num_computed_tokens != r.num_tokens:
            return  # still prefilling
        if r.num_tokens + 1 + len(drafts) > MAX_LEN:
            return self._finish(r)
        r.append_token_id(token)
        if not self._try_alloc(r, 1 + len(drafts)):
            return
        for t in drafts[: min(accept, len(drafts))]:
            r.append_token_id(t)
        r.append_token_id(token)  # the model's own sample after the accepted drafts
        r.num_computed_tokens = r.num_tokens - 1
        held = len(m.managers[0].req_to_blocks[r.request_id])
        keep = m.trim(r)
        need = -(-r.num_tokens // B)
        for g in m.managers:
            n = len(g.req_to_blocks[r.request_id])
            if m.policy == "reserve":
                assert keep is None and n == held
            else:
                assert n == min(held, need) and (keep is None) == (held <= need)

    @precondition(lambda self: self.running)
    @rule(idx=st.integers(0, 100))
    def finish(self, idx: int) -> None:
        self._finish(self.running[idx % len(self.running)])

    def _finish(self, r: SimpleRequest) -> None:
        assert self.m is not None
        if r.request_id in self.touched:
            self._ship()
        self.m.free(r)
        self.running.remove(r)

    @precondition(lambda self: self.running)
    @rule()
    def preempt_newest(self) -> None:
        assert self.m is not None
        r = self.running.pop()
        if r.request_id in self.touched:
            self._ship()
        self.m.free(r)
        r.num_computed_tokens = 0
        self.waiting.insert(0, r)

    @precondition(lambda self: self.running and self.m is not None and self.m.host is not None)
    @rule()
    def swap_newest(self) -> None:
        """Preempt by swapping; a full host tier falls back to recompute."""
        m = self.m
        assert m is not None
        r = self.running.pop()
        if r.request_id in self.touched:
            self._ship()
        before = snapshot(m)
        if m.swap_out(r):
            assert m.is_swapped(r.request_id) and m.has_request(r.request_id)
        else:
            assert snapshot(m) == before, "swap_out returned False but changed state"
            m.free(r)
            r.num_computed_tokens = 0
        self.waiting.insert(0, r)

    @precondition(lambda self: self.m is not None and self.m.host is not None)
    @rule()
    def ship(self) -> None:
        self._ship()

    @precondition(lambda self: any(self.m.is_swapped(r.request_id) for r in self.waiting))
    @rule()
    def abort_swapped(self) -> None:
        assert self.m is not None
        r = next(r for r in self.waiting if self.m.is_swapped(r.request_id))
        self.waiting.remove(r)
        self.m.free(r)
        assert not self.m.has_request(r.request_id)

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
        check_hashes_cover_real_tokens(self.m, self.running + self.waiting)

    def teardown(self) -> None:
        if self.m is None:
            return
        for r in list(self.running):
            self._finish(r)
        for r in self.waiting:
            if self.m.has_request(r.request_id):
                self.m.free(r)
        self._ship()
        self.m.check_integrity()
        assert self.m.num_free_blocks == self.m.pool.num_blocks - 1
        assert self.m.usage == 0.0
        host = self.m.host
        if host is not None:  # 0 leaked host blocks
            assert host.num_free_blocks == host.num_usable_blocks and not host.swapped


KVMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("KV_SM_EXAMPLES", "150")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVStateMachine = KVMachine.TestCase
