"""A scripted executor: deterministic tokens without a model, and a worker failure on cue.

Each request's next token depends on its own last token only, so what a request produces is
the same whatever it is batched with, and whether it was preempted. When a request whose id
starts with ``victim`` computes its ``fail_after``-th token, the executor raises
``WorkerGroupError`` once (as a worker group whose rank died); ``restart`` rebuilds it.
Picklable by value (see ``ray.cloudpickle.register_pickle_by_value``), so a Ray controller
actor can build an engine over it.
"""

from __future__ import annotations

import time
from typing import Any

from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.executor import WorkerGroupError
from pagedserve.messages import (
    KVCacheLayout,
    LayerKVSpec,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerReport,
)

VOCAB = 100


def next_token(last: int) -> int:
    return (last * 7 + 1) % VOCAB


class ScriptedExecutor:
    def __init__(self, fail_after: int = 3, step_s: float = 0.005) -> None:
        self.fail_after = fail_after
        self.step_s = step_s
        self.failed = False
        self.restarts = 0
        self.rows: dict[str, list[int]] = {}  # id -> tokens known to the worker
        self.computed: dict[str, int] = {}
        self.prompt_len: dict[str, int] = {}

    def initialize(self) -> WorkerReport:
        return WorkerReport([LayerKVSpec(2, 8, 2)], 1 << 20, VOCAB, 256, "cpu")

    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        pass

    def check_failure(self) -> None:
        return None

    def restart(self) -> WorkerReport:
        self.restarts += 1
        self.rows.clear()
        self.computed.clear()
        return self.initialize()

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        time.sleep(self.step_s)  # a step takes time, as a real one does
        for rid in so.finished_req_ids:
            self.rows.pop(rid, None)
            self.computed.pop(rid, None)
        for nr in so.new_reqs:
            self.rows[nr.req_id] = [*nr.prompt_token_ids, *nr.output_token_ids]
            self.computed[nr.req_id] = nr.num_computed_tokens
            self.prompt_len[nr.req_id] = len(nr.prompt_token_ids)
        c = so.cached_reqs
        for i, rid in enumerate(c.req_ids):
            self.rows[rid].extend(c.new_token_ids[i])
            self.computed[rid] = c.num_computed_tokens[i]
        out = ModelRunnerOutput(so.step_id)
        for rid, n in so.num_scheduled_tokens.items():
            row = self.rows[rid]
            self.computed[rid] += n
            if self.computed[rid] != len(row):
                continue  # a prefill chunk that does not reach the end yet
            produced = len(row) - self.prompt_len[rid]
            if (not self.failed and rid.split(":")[-1].startswith("victim")
                    and produced >= self.fail_after):
                self.failed = True
                raise WorkerGroupError(1, "node-scripted", "the worker actor died")
            out.req_ids.append(rid)
            out.sampled_token_ids.append([next_token(row[-1])])
        return out

    def shutdown(self) -> None:
        pass


def build_scripted_engine(config: Any, placement_group: Any = None) -> EngineCore:
    from pagedserve.controller.restarts import RestartPolicy

    return EngineCore(config, ScriptedExecutor(), tokenizer=None, eos_token_ids=(),
                      restarts=RestartPolicy(backoff_s=0.01))
