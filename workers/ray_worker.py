"""The worker actor: a thin Ray wrapper around one rank's ``Worker``.

The executor creates one actor per rank inside its placement group, drives the set-up calls
(``node_info``, ``init_distributed``, and ``collective_rpc`` of the ``Worker``'s ``open_store``,
``load_model``, ``init_kv_cache``) and then starts ``run``, the rank's step loop over the ZeroMQ
step channel. ``run`` never returns while
the rank is healthy: it returns when the controller says stop, and raises after reporting a
failed step, so the executor watches the ``run`` refs to learn that a rank is gone.

- ``max_restarts=0``: a restarted rank would be a fresh process outside the live process group;
  the executor rebuilds the whole group instead.
- Concurrency groups: the set-up calls and then ``run`` take the default group's one thread, so
  the weights are loaded and every step computes on the same thread, which keeps one OpenMP
  thread pool per process (each thread that computes gets its own pool; two would put more
  OpenMP threads than cores on the rank). ``ping``, ``stop`` and ``node_info`` answer on the
  ``control`` thread while ``run`` is busy. ``collective_rpc`` (any ``Worker`` method, by name) runs
  on the default thread during set-up and on the ``rpc`` thread once ``run`` holds that one,
  under the lock each step holds, so that it never overlaps this rank's step.
- The controller's death: Ray kills actors with their owner (these are never detached), and
  independently the loop checks, whenever no step came for ``liveness_after_s``, that the
  controller's step socket still accepts connections; if it is gone the actor exits.

Importing this module does not import torch (the controller imports it by path to get the actor
class); the ``Worker`` is imported inside the actor.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray

from pagedserve.config import EngineConfig
from pagedserve.net import parse_tcp_endpoint

__all__ = ["RayWorker", "controller_reachable"]

logger = logging.getLogger(__name__)

RUN_STOPPED = "stopped"
RUN_CONTROLLER_GONE = "controller-gone"


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _unshadow_sys_path() -> None:
    """Ray puts the driver's working directory on the actor's ``sys.path``. Started from the
    repository root, whose folders are this package's subpackages, that would make them
    importable as top-level modules (``kernels``, ``config``, ...) that shadow real packages;
    ``pagedserve`` itself is importable through its installation, so the entry goes."""
    root = _package_root()
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]


def _group_ranks_on_node(node_id: str) -> int:
    """How many ranks of this actor's worker group (its placement group) share its node."""
    pg = ray.util.get_current_placement_group()
    if pg is None:
        return 1
    nodes = ray.util.placement_group_table(pg).get("bundles_to_node_id", {})
    return max(1, sum(1 for n in nodes.values() if n == node_id))


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def controller_reachable(endpoint: str, timeout_s: float = 2.0) -> bool:
    """Whether something still accepts TCP connections on the controller's step endpoint.

    A closed or refused connection means the controller's sockets are gone (the process died);
    the probe connection is closed at once, before any ZMTP greeting, which ZeroMQ drops."""
    try:
        host, port = parse_tcp_endpoint(endpoint)
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


@ray.remote(max_restarts=0, concurrency_groups={"control": 1, "rpc": 1})
class RayWorker:
    """One rank. ``rank`` is fixed at creation (the executor ranks bundles before spawning)."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        _unshadow_sys_path()
        from pagedserve.workers.worker import Worker  # torch: only inside the actor

        self.rank = rank
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self._stop = threading.Event()
        self._step_lock = threading.Lock()  # held by each step and by each collective_rpc
        self._worker: Any = Worker(config, rank=rank)
        if self._worker.device.type == "cpu":
            from pagedserve.workers.cpu_process import share_cores

            threads = share_cores(_group_ranks_on_node(self.node_id))
            logger.info("rank %d computes on %d CPU threads", rank, threads)

    # -- set-up --------------------------------------------------------------------------------

    @ray.method(concurrency_group="control")  # read-only; answers while run() is busy
    def node_info(self) -> dict[str, Any]:
        ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        return {
            "rank": self.rank,
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "pid": os.getpid(),
            "gpu_ids": sorted(int(i) for i in ids),
            "device": str(self._worker.device),
            "torch_threads": _torch_threads(),
            "niceness": os.nice(0),
        }

    def init_distributed(
        self, master_addr: str | None, master_port: int | None, one_host: bool = False
    ) -> None:
        """Join the process group (rank 0 passes None: it hosts the store). The collectives
        bind to the interface of this node's Ray IP (the address the other nodes reach it at,
        whatever the host name resolves to), or to loopback when the group shares one host."""
        bind = "127.0.0.1" if one_host else self.node_ip
        where = f"{self.node_id} ({self.node_ip})"
        if self.rank == 0:
            self._worker.init_distributed(bind_address=bind, node=where)
        else:
            self._worker.init_distributed(master_addr, master_port, bind_address=bind, node=where)

    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """This rank's ``Worker.<method>(*args, **kwargs)``; never during one of its steps."""
        with self._step_lock:
            self._bind_device()
            return getattr(self._worker, method)(*args, **(kwargs or {}))

    # -- control (answers while run() is busy) -------------------------------------------------

    @ray.method(concurrency_group="control")
    def ping(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def stop(self) -> None:
        """Ask the loop to leave after its current receive (at most ``recv_timeout_s``)."""
        self._stop.set()

    # -- the step loop -------------------------------------------------------------------------

    def run(
        self,
        endpoints: Sequence[str | bytes],
        rank: int,
        is_output_rank: bool,
        recv_timeout_s: float = 1.0,
        liveness_after_s: float = 10.0,
    ) -> str:
        """Receive, execute and (on the output rank) reply, step after step.

        Returns ``"stopped"`` when the controller (or ``stop``) ends the loop. Raises, after
        sending a failure frame, when a step fails. Exits the actor when the controller has
        vanished (its step socket refuses connections)."""
        from pagedserve.workers.wire import (
            BadStepFrameError,
            ChannelStopped,
            StepReceiver,
            StepReceiveTimeout,
        )

        if rank != self.rank:
            raise ValueError(f"actor of rank {self.rank} asked to run as rank {rank}")
        self._bind_device()
        rx = StepReceiver(endpoints, rank, is_output_rank, node=self.node_id)
        try:
            idle_since = time.monotonic()
            while not self._stop.is_set():
                try:
                    step = rx.recv(timeout_s=recv_timeout_s)
                except StepReceiveTimeout:
                    if time.monotonic() - idle_since >= liveness_after_s:
                        if not controller_reachable(endpoints[0]):
                            logger.error("rank %d: the controller is gone; exiting", rank)
                            rx.close()
                            self._exit()
                            return RUN_CONTROLLER_GONE
                        idle_since = time.monotonic()
                    continue
                except ChannelStopped:
                    return RUN_STOPPED
                except BadStepFrameError:
                    logger.warning("rank %d: dropped a malformed frame", rank, exc_info=True)
                    continue
                idle_since = time.monotonic()
                try:
                    with self._step_lock:
                        out = self._worker.execute(step)
                    if is_output_rank:
                        rx.reply(out)
                except Exception as exc:
                    rx.reply_error(exc, step.step_id)
                    raise
            return RUN_STOPPED
        finally:
            rx.close()

    def _bind_device(self) -> None:
        # CUDA's current device is per thread, and the loop (and an rpc) may run on a thread
        # other than __init__'s.
        device = self._worker.device
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(device)

    def _exit(self) -> None:
        try:
            self._worker.shutdown()
        finally:
            ray.actor.exit_actor()
