"""Executors: how the engine core reaches its workers.

The engine core talks to an ``Executor`` only. ``LocalExecutor`` runs one ``Worker`` in this
process; the Ray executor (elsewhere) fans the same calls out to worker actors. The worker
module is imported by its path string inside ``LocalExecutor`` so that the controller's static
import graph never reaches torch (import-linter checks it).
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Protocol, TypeVar

from pagedserve.config import EngineConfig
from pagedserve.messages import (
    KVCacheLayout,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerReport,
    decode,
    encode,
)

__all__ = [
    "Executor",
    "ExecutorError",
    "LocalExecutor",
    "WorkerGroupError",
    "check_wire_default",
    "create_executor",
    "wire_roundtrip",
]

WORKER_MODULE = "pagedserve.workers.worker"
RAY_EXECUTOR_MODULE = "pagedserve.controller.ray_executor"
CHECK_WIRE_ENV = "PAGEDSERVE_CHECK_WIRE"

T = TypeVar("T")


class ExecutorError(RuntimeError):
    """Base class of the executors' errors."""


class WorkerGroupError(ExecutorError):
    """The worker group failed as a whole: a rank died, reported an error or missed its step
    deadline. Names the root-cause rank and its Ray node id (``rank`` -1 when no single rank is
    to blame). The group is unusable until the executor's ``restart()`` rebuilt it."""

    def __init__(self, rank: int, node_id: str, message: str) -> None:
        super().__init__(f"worker group failed: rank {rank} on node {node_id}: {message}")
        self.rank = rank
        self.node_id = node_id
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.node_id, self.message))


class Executor(Protocol):
    """The engine core's only handle on the workers. Calls are synchronous and in this order:
    ``initialize`` once, ``init_kv_cache`` once, ``execute`` per step, ``shutdown`` once."""

    def initialize(self) -> WorkerReport:
        """Start the workers, load the model; report KV needs, byte budget and vocab size."""
        ...

    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        """Allocate the KV pool the controller decided on."""
        ...

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; return the tokens sampled by the output rank."""
        ...

    def shutdown(self) -> None: ...

    # Optional, duck-typed (``RayExecutor`` has both; ``LocalExecutor`` neither):
    # ``restart() -> WorkerReport`` tears the worker group down and rebuilds it with the same KV
    # layout; ``failure -> WorkerGroupError | None`` is a failure its monitor found between steps.


def create_executor(config: EngineConfig, *, backend: str = "ray", **options: Any) -> Executor:
    """The executor for ``config``: ``"ray"`` (worker actors in a placement group; Ray must be
    initialised, see ``ray_executor.ensure_ray``) or ``"local"`` (one in-process worker, only for
    tensor_parallel_size 1). ``options`` go to the executor's constructor."""
    if backend == "local":
        tp = config.parallel.tensor_parallel_size
        if tp != 1:
            raise ValueError(f"the local executor runs one rank; tensor_parallel_size is {tp}")
        return LocalExecutor(config, **options)
    if backend == "ray":
        executor: Executor = importlib.import_module(RAY_EXECUTOR_MODULE).RayExecutor(
            config, **options
        )
        return executor
    raise ValueError(f"unknown executor backend {backend!r}; use 'ray' or 'local'")


def check_wire_default() -> bool:
    """Debug switch: ``PAGEDSERVE_CHECK_WIRE=1`` sends every in-process message through the
    msgpack codec, so a message that would not survive a process boundary fails at once."""
    return os.environ.get(CHECK_WIRE_ENV, "0") not in ("", "0", "false", "False")


def wire_roundtrip(message: T) -> T:
    """``decode(encode(message))``: what a remote worker would receive."""
    out: Any = decode(encode(message))
    if type(out) is not type(message):
        raise TypeError(f"{type(message).__name__} decoded as {type(out).__name__}")
    return out  # type: ignore[no-any-return]


class LocalExecutor:
    """One worker (rank 0) in this process; no Ray, no sockets."""

    def __init__(self, config: EngineConfig, *, check_wire: bool | None = None) -> None:
        self.config = config
        self.check_wire = check_wire_default() if check_wire is None else check_wire
        self._worker: Any = None

    def initialize(self) -> WorkerReport:
        worker_cls = importlib.import_module(WORKER_MODULE).Worker
        self._worker = worker_cls(self.config, rank=0)
        report: WorkerReport = self._worker.load_model()
        return wire_roundtrip(report) if self.check_wire else report

    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        self._require_worker().init_kv_cache(wire_roundtrip(layout) if self.check_wire else layout)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        worker = self._require_worker()
        if self.check_wire:
            out: ModelRunnerOutput = worker.execute(wire_roundtrip(scheduler_output))
            return wire_roundtrip(out)
        return worker.execute(scheduler_output)  # type: ignore[no-any-return]

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None

    def _require_worker(self) -> Any:
        if self._worker is None:
            raise RuntimeError("LocalExecutor.initialize() has not been called")
        return self._worker
