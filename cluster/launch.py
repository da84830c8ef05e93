"""Starting an engine on Ray: one controller actor per data-parallel replica, a client to each,
and the ``Router`` in front of them (one replica or several).

The launcher owns each replica's worker placement group: it reserves it before the controller
starts, hands it to the controller (whose executor places its ranks in it, and rebuilds them
there after a failure) and removes it when the router shuts down. A lost controller is
replaced by a new one in the same placement group (``cluster.replica``; the lost one's workers
die with it), and the router moves its requests.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pagedserve.cluster.placement import remove_quietly, reserve_worker_group
from pagedserve.cluster.ray_controller import ControllerActor, EngineFactory
from pagedserve.cluster.remote_client import RemoteEngineClient
from pagedserve.cluster.replica import Replica
from pagedserve.cluster.router import Router
from pagedserve.config import EngineConfig
from pagedserve.controller.restarts import RestartPolicy
from pagedserve.controller.tokenizer import Tokenizer, load_tokenizer

__all__ = ["ensure_ray", "start_controllers"]

logger = logging.getLogger(__name__)


def ensure_ray(
    address: str | None = None, *, num_cpus: int | None = None, **init_kwargs: Any
) -> Any:
    """Make sure this process is connected to Ray. Already connected: nothing changes. ``None``
    (or ``"local"``) starts a fresh local instance in-process (``num_cpus`` logical CPUs,
    default max(4, cores): each rank's CPU bundle needs one, even on a small machine; no
    dashboard; workers at normal priority), even where ``RAY_ADDRESS`` or a ``ray start``
    cluster exists; ``"auto"`` or an address attaches to a running cluster."""
    if ray.is_initialized():
        return None
    if address in (None, "local"):
        init_kwargs.setdefault("include_dashboard", False)
        # Ray starts its workers at nice 15 so that its daemons stay responsive on a node
        # busy with tasks. Here the ranks are the node's work: at nice 15 a rank's torch
        # threads lose their core to every wake-up of a daemon, the driver or the controller,
        # and the others then wait for it at the next parallel region, so the forward pass is
        # slower in the actor than in-process. The daemons keep their fair share.
        init_kwargs["_system_config"] = {
            "worker_niceness": 0, **init_kwargs.get("_system_config", {})
        }
        cpus = num_cpus if num_cpus is not None else max(4, os.cpu_count() or 1)
        return ray.init(address="local", num_cpus=cpus, **init_kwargs)
    return ray.init(address=address, **init_kwargs)


def start_controllers(
    config: EngineConfig,
    build: EngineFactory,
    *,
    model_name: str,
    reserve_workers: bool = True,
    placement_timeout_s: float = 60.0,
    ready_timeout_s: float = 600.0,
    restart_policy: Callable[[], RestartPolicy] | None = None,
) -> Router:
    """Reserve each replica's placement group (``reserve_workers``; off when the engine runs
    its model inside the controller), create the controller actors (spread over nodes when
    there are several), wait until each is ready and connect a client to each, behind a
    ``Router``. Ray must be up. A lost controller is replaced in its replica's placement group
    under a policy from ``restart_policy`` (one per replica; None: ``controller_restarts``).
    """
    par = config.parallel
    dp = par.data_parallel_size
    pgs: list[Any] = []
    actors: list[Any] = []
    replicas: list[Replica] = []
    policy = restart_policy or controller_restarts
    try:
        if reserve_workers:
            pgs = [
                reserve_worker_group(par.world_size, par.placement_strategy, placement_timeout_s)
                for _ in range(dp)
            ]
        # One replica: its controller on the driver's node, next to the client and to rank 0,
        # so that losing another node costs ranks, never the engine itself (the driver's node
        # is alive: it runs this). Not soft: Ray's soft affinity does not hold an actor that
        # asks for no resources. Several replicas: spread, one controller per node.
        strategy: Any = "SPREAD" if dp > 1 else NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False
        )
        spawn = functools.partial(_spawn, config, build, model_name, strategy)
        actors = [spawn(pgs[i] if pgs else None, i) for i in range(dp)]
        infos = ray.get([a.info.remote() for a in actors], timeout=ready_timeout_s)
        tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
        for i, (actor, info) in enumerate(zip(actors, infos, strict=True)):
            logger.info("replica %d: %s on node %s", info["replica_index"], info["endpoint"],
                        info["node_id"])
            pg = pgs[i] if pgs else None
            replicas.append(Replica(
                i, functools.partial(_connect, actor, info, tokenizer),
                restart=functools.partial(_restart, spawn, pg, i, tokenizer, ready_timeout_s),
                restarts=policy(), close=functools.partial(remove_quietly, pg),
            ))
    except BaseException as exc:
        for replica in replicas:
            replica.shutdown()
        for actor in actors[len(replicas):]:
            ray.kill(actor, no_restart=True)
        for pg in pgs[len(replicas):]:
            remove_quietly(pg)
        raise _cause(exc) from None
    return Router(replicas, block_size=replicas[0].block_size)


def controller_restarts() -> RestartPolicy:
    """A replica's policy for replacing its controller: as the worker group's, but the first
    replacement starts at once (its requests wait for it)."""
    return RestartPolicy(backoff_s=0.1)


def _spawn(config: EngineConfig, build: EngineFactory, model_name: str, strategy: Any,
           pg: Any, index: int) -> Any:
    return ControllerActor.options(scheduling_strategy=strategy).remote(
        config, build, model_name=model_name, placement_group=pg, replica_index=index,
    )


def _connect(actor: Any, info: dict[str, Any], tokenizer: Tokenizer | None,
             on_lost: Callable[[str], None]) -> RemoteEngineClient:
    return RemoteEngineClient(info["endpoint"], info, tokenizer=tokenizer, actor=actor,
                              on_close=functools.partial(_stop_controller, actor),
                              on_lost=on_lost)


def _restart(spawn: Callable[[Any, int], Any], pg: Any, index: int, tokenizer: Tokenizer | None,
             ready_timeout_s: float, on_lost: Callable[[str], None]) -> RemoteEngineClient:
    """A new controller for replica ``index`` in its placement group (the lost one's workers
    die with it and free their bundles), and a client to it."""
    actor = spawn(pg, index)
    try:
        info = ray.get(actor.info.remote(), timeout=ready_timeout_s)
    except BaseException as exc:
        ray.kill(actor, no_restart=True)
        raise _cause(exc) from None
    logger.info("replica %d: a new controller at %s on node %s", index, info["endpoint"],
                info["node_id"])
    return _connect(actor, info, tokenizer, on_lost)


def _cause(exc: BaseException) -> BaseException:
    """What the controller raised, out of Ray's wrapping (a ``RayTaskError``'s cause)."""
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, Exception):
        return exc.cause
    return exc


def _stop_controller(actor: Any, timeout_s: float = 30.0) -> None:
    """Stop the controller (and so its workers) and kill it."""
    try:
        ray.get(actor.shutdown.remote(), timeout=timeout_s)
    except Exception as exc:  # already dead, or stuck: the kill below settles it
        logger.debug("controller shutdown: %r", exc)
    ray.kill(actor, no_restart=True)
