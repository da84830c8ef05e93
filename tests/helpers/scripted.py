"""The fake executor with a worker failure on cue, for engines that a Ray controller builds.

Tokens follow ``next_token`` (the seed is ignored). When a request whose id starts with
``victim`` is about to sample its ``fail_after``-th token, the executor raises
``WorkerGroupError`` once (as a worker group whose rank died); ``restart`` rebuilds it.
Picklable by value (register this module and ``helpers.fake_executor`` with
``ray.cloudpickle.register_pickle_by_value``), so a Ray controller actor can build an engine
over it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from helpers.fake_executor import FakeExecutor, Row
from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.executor import WorkerGroupError

VOCAB = 100


def next_token(last: int, seed: int | None = None, vocab: int = VOCAB) -> int:
    return (last * 7 + 1) % vocab


def greedy_after(last: int, n: int) -> list[int]:
    """The ``n`` tokens after ``last``: what an uninterrupted run gives."""
    out = []
    for _ in range(n):
        last = next_token(last)
        out.append(last)
    return out


@dataclass
class ScriptedExecutor(FakeExecutor):
    vocab_size: int = VOCAB
    num_layers: int = 1
    rule: Callable[[int, int | None, int], int] = next_token
    step_s: float = 0.005  # a step takes time, as a real one does
    fail_after: int = 3
    failed: bool = False

    def sample(self, rid: str, row: Row) -> int:
        produced = len(row.tokens) - row.prompt_len
        if (not self.failed and rid.split(":")[-1].startswith("victim")
                and produced >= self.fail_after):
            self.failed = True
            raise WorkerGroupError(1, "node-scripted", "the worker actor died")
        return super().sample(rid, row)


def build_scripted_engine(config: Any, placement_group: Any = None) -> EngineCore:
    from pagedserve.controller.restarts import RestartPolicy

    return EngineCore(config, ScriptedExecutor(), tokenizer=None, eos_token_ids=(),
                      restarts=RestartPolicy(backoff_s=0.01))
