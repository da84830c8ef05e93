"""A miniature controller that drives a ``Worker`` with hand-built ``SchedulerOutput`` deltas.

Blocks come from one shuffled pool shared by all KV groups (so ids are scattered and never
collide across groups); each step fills a token budget running-first, which chunks long
prompts over several steps; sampled tokens are fed back through ``new_token_ids``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pagedserve.messages import (
    CachedRequestData,
    KVCacheLayout,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)


@dataclass
class _Req:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    output: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[list[int]] = field(default_factory=list)
    sent: bool = False
    tokens_sent: int = 0  # how many of prompt+output the worker already holds

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


def layout_for(report, num_blocks: int, block_size: int) -> KVCacheLayout:
    """Groups layers by sliding window, like the controller's grouping (equal-size groups)."""
    by_window: dict[int | None, list[int]] = {}
    for i, spec in enumerate(report.layer_specs):
        by_window.setdefault(spec.sliding_window, []).append(i)
    groups = list(by_window.values())
    assert len({len(g) for g in groups}) == 1, groups
    return KVCacheLayout(num_blocks=num_blocks, block_size=block_size, groups=groups)


class Stepper:
    def __init__(self, worker, layout: KVCacheLayout, seed: int = 0, cp_size: int = 1) -> None:
        self.worker = worker
        # With decode context parallelism one block id covers B * W tokens (the virtual block).
        self.block_size = layout.block_size * cp_size
        self.num_groups = len(layout.groups)
        self.free = list(range(1, layout.num_blocks))  # block 0 is the null block
        random.Random(seed).shuffle(self.free)
        self.reqs: dict[str, _Req] = {}
        self.finished: list[str] = []
        self.step_id = 0
        self.outputs = []

    def add(
        self,
        req_id: str,
        prompt: list[int],
        max_tokens: int,
        params: SamplingParams | None = None,
        output: list[int] | None = None,
    ) -> None:
        params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens)
        r = _Req(req_id, list(prompt), params, max_tokens, output=list(output or []))
        r.blocks = [[] for _ in range(self.num_groups)]
        self.reqs[req_id] = r

    def drop(self, req_id: str) -> _Req:
        """Finish or preempt: the worker drops the row, the blocks go back to the pool."""
        r = self.reqs.pop(req_id)
        self.finished.append(req_id)
        for ids in r.blocks:
            self.free.extend(ids)
        return r

    def step(self, budget: int = 64) -> dict[str, int]:
        so = SchedulerOutput(step_id=self.step_id, finished_req_ids=self.finished)
        self.finished = []
        cached = CachedRequestData()
        for r in self.reqs.values():
            n = min(len(r.tokens) - r.computed, budget)
            if n <= 0:
                continue
            budget -= n
            need = -(-(r.computed + n) // self.block_size)
            new_ids = []
            for g in range(self.num_groups):
                ids = [self.free.pop() for _ in range(need - len(r.blocks[g]))]
                r.blocks[g].extend(ids)
                new_ids.append(ids)
            so.num_scheduled_tokens[r.req_id] = n
            if not r.sent:
                so.new_reqs.append(
                    NewRequestData(
                        r.req_id,
                        list(r.prompt),
                        list(r.output),
                        r.params,
                        [list(b) for b in r.blocks],
                        r.computed,
                    )
                )
                r.sent = True
            else:
                cached.req_ids.append(r.req_id)
                cached.new_token_ids.append(r.tokens[r.tokens_sent :])
                cached.new_block_ids.append(new_ids if any(new_ids) else None)
                cached.num_computed_tokens.append(r.computed)
            r.tokens_sent = len(r.tokens)
            r.computed += n
        so.cached_reqs = cached
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        out = self.worker.execute(so)
        self.outputs.append(out)
        self.step_id += 1
        pairs = zip(out.req_ids, out.sampled_token_ids, strict=True)
        sampled = {rid: toks[0] for rid, toks in pairs}  # no drafts: one token each
        for rid, tok in sampled.items():
            self.reqs[rid].output.append(tok)
        return sampled

    def run(self, budget: int = 64, max_steps: int = 1000) -> dict[str, list[int]]:
        """Step until every request has ``max_tokens`` outputs; returns and drops them all."""
        done: dict[str, list[int]] = {}
        for _ in range(max_steps):
            for rid in [rid for rid, r in self.reqs.items() if len(r.output) >= r.max_tokens]:
                done[rid] = self.drop(rid).output
            if not self.reqs:
                return done
            self.step(budget)
        raise RuntimeError("requests did not finish")
