"""``RayExecutor``: the worker group as Ray actors in one placement group, one rank per bundle.

Build (``initialize`` + ``init_kv_cache``, and again on ``restart``):

1. The placement group (``world_size`` bundles) is the launcher's, who creates and removes it;
   the executor waits until it is placed (again, after a node's death).
2. Ranks from the placement table, the controller's node first (``placement.rank_order``); one
   ``RayWorker`` actor per bundle, created with its rank.
3. Rank 0 opens the TCPStore on port 0 and reports the port; every rank joins the process
   group (gloo on CPU, NCCL on GPU) and loads its shard; rank 0's ``WorkerReport`` is the group's.
4. ``init_kv_cache``: every rank allocates the pool; then the ``StepChannel`` is bound on the
   controller's node IP, port 0, every rank starts ``run`` and the handshake completes.

Per step, ``submit`` broadcasts the ``SchedulerOutput`` and ``collect`` (maybe after the next
step's ``submit``: async scheduling) waits for the output rank's reply in short slices, checking
between them whether a rank's ``run`` ref has finished (a silent death is noticed in about a
second); a monitor does the same between steps. A failure becomes one ``WorkerGroupError``
naming the root-cause rank and node; the group is killed at once.

Every other call into the workers is ``collective_rpc``: one generic actor method that calls the
``Worker`` method of that name on each rank (on the actors' default thread during the build, on
their ``rpc`` thread once the step loops hold the default one).

Ray must be initialised by the caller (``cluster.launch.ensure_ray`` helps). Every wait is bounded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedserve.cluster.placement import RankSlot, rank_slots, wait_placed, warn_if_split
from pagedserve.cluster.rank_calls import (
    find_dead_rank,
    find_silent_rank,
    gather_ranks,
)
from pagedserve.cluster.wire import StepChannel
from pagedserve.cluster.wire_frames import (
    BadFrameError,
    RankDisconnectedError,
    StepTimeoutError,
    WorkerStepError,
)
from pagedserve.config import EngineConfig
from pagedserve.controller.executor import WorkerGroupError
from pagedserve.messages import KVCacheLayout, ModelRunnerOutput, SchedulerOutput, WorkerReport

__all__ = ["RayExecutor"]

logger = logging.getLogger(__name__)

OUTPUT_RANK = 0


class RayExecutor:
    """The ``Executor`` over Ray worker actors (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        placement_group: Any,
        actor_cls: Any,
        *,
        placement_timeout_s: float = 60.0,
        ready_timeout_s: float = 600.0,
        step_timeout_s: float = 300.0,
        poll_interval_s: float = 0.5,
        monitor_interval_s: float = 1.0,
        ping_timeout_s: float = 5.0,
        on_failure: Callable[[WorkerGroupError], None] | None = None,
    ) -> None:
        self.config = config
        self.world_size = config.parallel.world_size
        self.overlaps_steps = self.world_size == 1  # placeholders take the rank's own samples
        self.placement_timeout_s = placement_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.step_timeout_s = step_timeout_s
        self.poll_interval_s = poll_interval_s
        self.monitor_interval_s = monitor_interval_s
        self.ping_timeout_s = ping_timeout_s
        self._actor_cls = actor_cls
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._failure: WorkerGroupError | None = None
        self._pg: Any = placement_group
        self._slots: list[RankSlot] = []
        self._rank_nodes: list[dict[str, Any]] = []
        self._actors: list[Any] = []
        self._run_refs: dict[Any, int] = {}
        self._channel: StepChannel | None = None
        self._layout: KVCacheLayout | None = None
        self._monitor: threading.Thread | None = None
        self._monitor_stop = threading.Event()
        self._closed = False
        self.num_restarts = 0

    # ------------------------------------------------------------------ Executor protocol
    def initialize(self) -> WorkerReport:
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised: call launch.ensure_ray(address) first")
        try:
            return self._build()
        except BaseException:
            self._teardown()
            raise

    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        self._layout = layout
        try:
            self._rpc(self._actors, "init_kv_cache", (layout,))
            self._start_loops()
        except BaseException:
            self._teardown()
            raise

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.collect()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Send a step to every rank; ``collect`` waits for its output."""
        self._raise_if_failed()
        chan = self._channel
        if chan is None:
            raise RuntimeError("RayExecutor: init_kv_cache() must run before execute()")
        try:
            chan.broadcast(scheduler_output)
        except (RankDisconnectedError, StepTimeoutError) as exc:
            rank = exc.rank if isinstance(exc, RankDisconnectedError) else -1
            raise self._fail(self._dead_rank(1.0) or self._error(rank, str(exc))) from exc

    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest step submitted and not yet collected."""
        chan = self._channel
        assert chan is not None, "collect() before submit()"
        deadline = time.monotonic() + self.step_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                return chan.recv_reply(min(self.poll_interval_s, max(remaining, 0.0)))
            except StepTimeoutError as exc:
                self._raise_if_failed()
                dead = self._dead_rank(0.0)
                if dead is not None:
                    raise self._fail(dead) from exc
                if remaining <= 0:
                    what = f"no output within the step timeout ({self.step_timeout_s:.1f} s)"
                    raise self._fail(self._error(OUTPUT_RANK, what)) from exc
            except WorkerStepError as exc:
                # A rank's report may be the echo of another rank's death (a collective that
                # lost its peer): prefer a rank that died as the root cause.
                dead = self._dead_rank(1.0, exclude=exc.rank, died_only=True)
                err = dead or self._error(exc.rank, f"{exc.exc_type}: {exc.message}")
                raise self._fail(err) from exc
            except BadFrameError:
                logger.warning("dropped a malformed reply frame", exc_info=True)

    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """``Worker.<method>(*args, **kwargs)`` on every rank, between steps; results by rank.
        A rank's failure raises ``WorkerGroupError`` naming it (its exception is the cause)."""
        self._raise_if_failed()
        return self._rpc(self._actors, method, args, kwargs)

    def _rpc(self, actors: list[Any], method: str, args: Sequence[Any] = (),
             kwargs: dict[str, Any] | None = None) -> list[Any]:
        group = "rpc" if self._channel is not None else None  # the loops hold the default one
        calls = [a.collective_rpc.options(concurrency_group=group) for a in actors]
        return self._gather([c.remote(method, args, kwargs) for c in calls], method)

    def shutdown(self) -> None:
        """Stop the loops, kill every rank, close the channel. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._teardown(graceful=True)

    # ------------------------------------------------------------------ faults
    def check_failure(self) -> WorkerGroupError | None:
        """The group's failure, if one was found (by a step or by the monitor)."""
        return self._failure

    @property
    def rank_table(self) -> list[RankSlot]:
        """Rank -> (bundle, node id) of the current group."""
        return list(self._slots)

    def rank_nodes(self) -> list[dict[str, Any]]:
        """Rank -> node id and node IP of the current group (for users' logs and tests)."""
        return [dict(r) for r in self._rank_nodes]

    def worker_actors(self) -> list[Any]:
        """The worker actors, by rank (for tests and diagnostics)."""
        return list(self._actors)

    def restart(self) -> WorkerReport:
        """Tear the group down and build it again in the same placement group (actors, process
        group, model, and the KV layout of the first build). Returns the new report."""
        if self._closed:
            raise RuntimeError("RayExecutor: restart after shutdown")
        self._teardown()
        self.num_restarts += 1
        logger.warning("rebuilding the worker group (restart %d)", self.num_restarts)
        try:
            report = self._build()
            if self._layout is not None:
                self._rpc(self._actors, "init_kv_cache", (self._layout,))
                self._start_loops()
            return report
        except BaseException:
            self._teardown()
            raise

    def _error(self, rank: int, message: str) -> WorkerGroupError:
        node = self._slots[rank].node_id if 0 <= rank < len(self._slots) else "?"
        ip = self._rank_nodes[rank]["node_ip"] if 0 <= rank < len(self._rank_nodes) else ""
        return WorkerGroupError(rank, node, message, ip)

    def _fail(self, err: WorkerGroupError) -> WorkerGroupError:
        """Record the group's failure once (the first one is the root cause) and kill the
        ranks, so that survivors stuck in a collective stop at once. Returns the recorded
        failure. Safe from the monitor thread: it does not touch the channel."""
        with self._lock:
            first = self._failure is None
            if first:
                self._failure = err
            recorded = self._failure
        assert recorded is not None
        if first:
            logger.error("%s", err)
            self._kill_actors()
            if self._on_failure is not None:
                try:
                    self._on_failure(err)
                except Exception:
                    logger.exception("on_failure callback failed")
        return recorded

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _dead_rank(
        self, wait_s: float, exclude: int | None = None, died_only: bool = False
    ) -> WorkerGroupError | None:
        """The root-cause rank of a failure, or None while every rank (but ``exclude``) runs.

        A rank whose ``run`` ended (waiting up to ``wait_s`` for the first), preferring one whose
        actor died (only those with ``died_only``). A rank whose step merely failed is often the
        echo of a peer lost with its node, which Ray declares dead only after its health checks:
        then a rank that no longer answers a ping is the cause."""
        found = find_dead_rank(self._run_refs, wait_s, exclude, died_only)
        if found is None and not died_only:
            return None
        if found is None or found[0] != 0:
            silent = find_silent_rank(self._actors, self.ping_timeout_s)
            if silent is not None:
                return self._error(*silent)
        return None if found is None else self._error(found[1], found[2])

    # ------------------------------------------------------------------ build / teardown
    def _build(self) -> WorkerReport:
        with self._lock:
            self._failure = None
        controller_node = ray.get_runtime_context().get_node_id()
        if self._pg.bundle_count != self.world_size:
            raise ValueError(
                f"the placement group has {self._pg.bundle_count} bundles for "
                f"{self.world_size} ranks"
            )
        wait_placed(self._pg, self.placement_timeout_s)
        bundle = self._pg.bundle_specs[0]
        self._slots = rank_slots(self._pg, controller_node)
        logger.info(
            "worker group ranks: %s",
            ", ".join(f"{s.rank}->bundle {s.bundle_index}@{s.node_id[:12]}" for s in self._slots),
        )
        actor_cls = self._actor_cls
        gpu = bundle.get("GPU", 0.0)
        self._actors = [
            actor_cls.options(
                num_cpus=bundle.get("CPU", 0.0),
                num_gpus=gpu,
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg,
                    placement_group_bundle_index=slot.bundle_index,
                    placement_group_capture_child_tasks=True,
                ),
            ).remote(self.config, slot.rank)
            for slot in self._slots
        ]
        infos = self._gather([a.node_info.remote() for a in self._actors], "start")
        for slot, info in zip(self._slots, infos, strict=True):
            if info["node_id"] != slot.node_id:
                raise WorkerGroupError(
                    slot.rank, info["node_id"], f"rank placed off its bundle's node {slot.node_id}"
                )
        self._rank_nodes = [
            {"rank": i["rank"], "node_id": i["node_id"], "node_ip": i["node_ip"]} for i in infos
        ]
        warn_if_split(self._rank_nodes, self.config.parallel.placement_strategy)
        if self.world_size > 1:
            self._init_distributed(infos)
        report: WorkerReport = self._rpc(self._actors, "load_model")[OUTPUT_RANK]
        return report

    def _init_distributed(self, infos: list[dict[str, Any]]) -> None:
        # One host: everything over loopback. Several: rank 0's Ray node IP for the store, and
        # each rank binds its collectives to the interface of its own node IP.
        one_node = len({i["node_id"] for i in infos}) == 1
        host = "127.0.0.1" if one_node else infos[0]["node_ip"]
        (port,) = self._rpc(self._actors[:1], "open_store", (host,))
        refs = [a.init_distributed.remote(host, port, one_node) for a in self._actors]
        self._gather(refs, "init_distributed")

    def _start_loops(self) -> None:
        host = ray.util.get_node_ip_address()
        self._channel = StepChannel(self.world_size, host=host, output_rank=OUTPUT_RANK)
        endpoints = self._channel.endpoints
        self._run_refs = {
            a.run.remote(endpoints, rank, rank == OUTPUT_RANK): rank
            for rank, a in enumerate(self._actors)
        }
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._channel.ready:
            # Handshake in short slices, so that a rank whose loop died is reported at once.
            dead = self._dead_rank(0.0)
            if dead is not None:
                raise self._fail(dead)
            remaining = deadline - time.monotonic()
            try:
                self._channel.wait_ready(timeout_s=min(self.poll_interval_s, max(remaining, 0)))
            except TimeoutError:
                if remaining <= 0:
                    raise
        self._start_monitor()

    def _gather(self, refs: list[Any], what: str) -> list[Any]:
        return gather_ranks(refs, what, self.ready_timeout_s, self._error)

    def _start_monitor(self) -> None:
        self._monitor_stop = stop = threading.Event()
        self._monitor = threading.Thread(target=self._monitor_loop, args=(stop,),
                                         name="pagedserve-rank-monitor", daemon=True)
        self._monitor.start()

    def _monitor_loop(self, stop: threading.Event) -> None:
        # Polls with a short timeout rather than blocking in ray.wait, so that shutdown can
        # stop it before Ray goes away underneath.
        refs = list(self._run_refs)
        while not stop.is_set() and self._failure is None:
            try:
                done, _ = ray.wait(refs, num_returns=1, timeout=self.monitor_interval_s)
            except Exception:  # Ray is shutting down
                return
            if done and not stop.is_set():
                dead = self._dead_rank(0.5)
                if dead is not None and not stop.is_set():
                    self._fail(dead)
                return

    def _stop_monitor(self) -> None:
        self._monitor_stop.set()
        mon, self._monitor = self._monitor, None
        if mon is not None and mon is not threading.current_thread():
            mon.join(timeout=self.monitor_interval_s + 5.0)

    def _kill_actors(self) -> None:
        if not ray.is_initialized():
            return
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                logger.debug("ray.kill failed", exc_info=True)

    def _teardown(self, graceful: bool = False) -> None:
        """Everything back to nothing; safe to call at any stage of a build, and repeatedly."""
        self._stop_monitor()
        chan, self._channel = self._channel, None
        if chan is not None:
            try:
                if graceful and chan.ready and self._failure is None:
                    chan.stop_workers(timeout_s=2.0)
            except Exception:
                logger.debug("stop_workers failed", exc_info=True)
            chan.close()
        self._kill_actors()
        self._actors = []
        self._run_refs = {}
