"""Starting an engine on Ray: one controller actor per data-parallel replica, a client to each.

The launcher owns each replica's worker placement group: it reserves it before the controller
starts, hands it to the controller (whose executor places its ranks in it, and rebuilds them
there after a failure) and removes it when the client shuts down, so a killed controller leaves
nothing reserved. With ``data_parallel_size`` above 1 the front end gets a prefix-aware
``Router`` over one client per replica.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pagedserve.cluster.placement import remove_quietly, reserve_worker_group
from pagedserve.cluster.ray_controller import ControllerActor, EngineFactory
from pagedserve.cluster.remote_client import RemoteEngineClient
from pagedserve.cluster.router import Router
from pagedserve.config import EngineConfig
from pagedserve.controller.client import EngineClient
from pagedserve.controller.tokenizer import load_tokenizer

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
) -> EngineClient:
    """Reserve each replica's placement group (``reserve_workers``; off when the engine runs
    its model inside the controller), create the controller actors (spread over nodes when
    there are several), wait until each is ready and connect a client to each. Ray must be up.
    """
    par = config.parallel
    dp = par.data_parallel_size
    pgs: list[Any] = []
    actors: list[Any] = []
    clients: list[RemoteEngineClient] = []
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
        actors = [
            ControllerActor.options(scheduling_strategy=strategy).remote(
                config, build, model_name=model_name,
                placement_group=pgs[i] if pgs else None, replica_index=i,
            )
            for i in range(dp)
        ]
        infos = ray.get([a.info.remote() for a in actors], timeout=ready_timeout_s)
        tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
        for i, (actor, info) in enumerate(zip(actors, infos, strict=True)):
            logger.info("replica %d: %s on node %s", info["replica_index"], info["endpoint"],
                        info["node_id"])
            close = functools.partial(_close_replica, actor, pgs[i] if pgs else None)
            clients.append(RemoteEngineClient(
                info["endpoint"], info, tokenizer=tokenizer, actor=actor, on_close=close
            ))
    except BaseException as exc:
        for client in clients:
            client.shutdown()
        for actor in actors[len(clients):]:
            ray.kill(actor, no_restart=True)
        for pg in pgs[len(clients):]:
            remove_quietly(pg)
        cause = getattr(exc, "cause", None)  # a RayTaskError carries what the controller raised
        if isinstance(cause, Exception):
            raise cause from None
        raise
    if dp == 1:
        return clients[0]
    return Router(clients, block_size=clients[0].block_size)


def _close_replica(actor: Any, pg: Any, timeout_s: float = 30.0) -> None:
    """Stop the controller (and so its workers), kill it, free its placement group."""
    try:
        ray.get(actor.shutdown.remote(), timeout=timeout_s)
    except Exception as exc:  # already dead, or stuck: the kill below settles it
        logger.debug("controller shutdown: %r", exc)
    ray.kill(actor, no_restart=True)
    remove_quietly(pg)
