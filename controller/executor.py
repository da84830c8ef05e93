"""Executors: how the engine core reaches its workers.

The engine core talks to an ``Executor`` only. ``LocalExecutor`` runs one worker in this process,
made by a factory the composition root (``pagedserve.builder``) hands it, so nothing here names
the workers; the Ray executor (``cluster/ray_executor.py``) fans the same calls out to worker
actors.

Besides the step (``execute``, the hot path, with a transport of its own), every call into the
workers is ``collective_rpc(method, args, kwargs)``: a public method of the worker class, called
by name on every rank. A new worker operation is one method there and nothing here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from pagedserve.messages import KVCacheLayout, ModelRunnerOutput, SchedulerOutput, WorkerReport

__all__ = ["Executor", "ExecutorError", "LocalExecutor", "WorkerGroupError", "WorkerLike"]


class ExecutorError(RuntimeError):
    """Base class of the executors' errors."""


class WorkerGroupError(ExecutorError):
    """The worker group failed as a whole: a rank died, reported an error or missed its step
    deadline. Names the root-cause rank, its Ray node id and, where known, the node's IP
    (``rank`` -1 when no single rank is to blame). The group is unusable until the executor's
    ``restart()`` rebuilt it."""

    def __init__(self, rank: int, node_id: str, message: str, node_ip: str = "") -> None:
        where = f"{node_id} ({node_ip})" if node_ip else node_id
        super().__init__(f"worker group failed: rank {rank} on node {where}: {message}")
        self.rank = rank
        self.node_id = node_id
        self.node_ip = node_ip
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.node_id, self.message, self.node_ip))


class Executor(Protocol):
    """The engine core's only handle on the workers. Calls are synchronous: ``initialize``
    once, ``init_kv_cache`` once, then ``execute`` per step (``check_failure`` between steps),
    ``restart`` after a failure, ``shutdown`` once."""

    def initialize(self) -> WorkerReport:
        """Start the workers, load the model; report KV needs, byte budget and vocab size."""
        ...

    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        """Allocate the KV pool the controller decided on."""
        ...

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; return the tokens sampled by the output rank. Raises
        ``WorkerGroupError`` when the group failed."""
        ...

    # An executor whose ``overlaps_steps`` is True also has ``submit(scheduler_output)`` and
    # ``collect() -> ModelRunnerOutput``, ``execute`` in two halves: the engine may submit the
    # next step before it collects the last one (async scheduling). One without the attribute
    # runs one step at a time.

    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Call the worker's ``method(*args, **kwargs)`` on every rank, between steps (never
        during one); returns the results by rank."""
        ...

    def check_failure(self) -> WorkerGroupError | None:
        """A failure found between steps (a rank died while idle), else None."""
        ...

    def restart(self) -> WorkerReport:
        """Tear the worker group down and rebuild it with the same KV layout."""
        ...

    def shutdown(self) -> None: ...


class WorkerLike(Protocol):
    """What ``LocalExecutor`` needs of a worker (``workers.worker.Worker`` is one): the step,
    and these set-up methods, which it reaches by name like any other."""

    def load_model(self) -> WorkerReport: ...

    def init_kv_cache(self, layout: KVCacheLayout) -> None: ...

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """One worker (rank 0) in this process; no Ray, no sockets. ``restart`` makes a new one."""

    def __init__(self, make_worker: Callable[[], WorkerLike]) -> None:
        self._make_worker = make_worker
        self._worker: WorkerLike | None = None
        self._layout: KVCacheLayout | None = None

    def initialize(self) -> WorkerReport:
        self._worker = self._make_worker()
        report: WorkerReport = self.collective_rpc("load_model")[0]
        return report

    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        self._layout = layout
        self.collective_rpc("init_kv_cache", (layout,))

    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """The worker's own result, or its own exception (nothing is wrapped in process)."""
        return [getattr(self._require_worker(), method)(*args, **(kwargs or {}))]

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        worker = self._require_worker()
        try:
            return worker.execute(scheduler_output)
        except Exception as exc:
            # The in-process rank failed mid-step (its KV pool may be half copied): the same
            # fault as a remote rank's, so the engine fails the step's requests and rebuilds.
            raise WorkerGroupError(0, "local", f"{type(exc).__name__}: {exc}") from exc

    def check_failure(self) -> WorkerGroupError | None:
        return None  # an in-process worker fails inside execute, never between steps

    def restart(self) -> WorkerReport:
        self.shutdown()
        report = self.initialize()
        if self._layout is not None:
            self.collective_rpc("init_kv_cache", (self._layout,))
        return report

    def shutdown(self) -> None:
        if self._worker is not None:
            self.collective_rpc("shutdown")
            self._worker = None

    def _require_worker(self) -> WorkerLike:
        if self._worker is None:
            raise RuntimeError("LocalExecutor.initialize() has not been called")
        return self._worker
