"""Starting an engine for a front end: resolve the model, build the engine, hand back a client.

Two backends:

- ``ray`` (the default): Ray is started locally, or attached to with ``ray_address`` (``auto``
  or an address); one controller actor per data-parallel replica (each with its own worker
  group), and the front end gets a ``RemoteEngineClient`` -- or, with ``data_parallel_size``
  above 1, a prefix-aware ``Router`` over one client per replica;
- ``local``: the engine runs in this process on a background thread (``EngineThread``), no Ray
  at all; for tests and debugging, tensor_parallel_size 1 only.

``PAGEDSERVE_BACKEND`` (``ray`` / ``local``) overrides the default when no backend is passed.
"""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path
from typing import Any

from pagedserve.config import EngineConfig
from pagedserve.controller.client import EngineClient, EngineThread
from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.executor import LocalExecutor
from pagedserve.controller.tokenizer import load_tokenizer

__all__ = [
    "BACKEND_ENV",
    "model_name",
    "resolve_backend",
    "resolve_model_dir",
    "start_controllers",
    "start_engine",
]

logger = logging.getLogger(__name__)

BACKEND_ENV = "PAGEDSERVE_BACKEND"
BACKENDS = ("ray", "local")


def resolve_model_dir(model: str | None) -> str:
    """The checkpoint directory to serve for what the user named: None is the default real
    model (SmolLM2-135M-Instruct, converted once into the user cache), ``"demo"`` the random
    demo checkpoint, a ``.gguf`` file a converted copy, a checkpoint directory itself (see
    ``workers/checkpoints.py``; raises ``UnknownModelError``, a ``ConfigError``, otherwise)."""
    checkpoints = importlib.import_module("pagedserve.workers.checkpoints")
    return str(checkpoints.prepare_checkpoint(model))


def model_name(config: EngineConfig) -> str:
    """The name clients address the model by: the checkpoint directory's name."""
    return Path(config.model.model).name or config.model.model


def resolve_backend(config: EngineConfig, backend: str | None = None) -> str:
    """``backend`` if given, else ``$PAGEDSERVE_BACKEND``, else ``ray``. A ``ray_address`` or
    more than one rank or replica needs Ray: asking for ``local`` then is an error."""
    chosen = backend or os.environ.get(BACKEND_ENV) or "ray"
    if chosen not in BACKENDS:
        raise ValueError(f"unknown backend {chosen!r}; use one of {', '.join(BACKENDS)}")
    par = config.parallel
    needs_ray = par.world_size > 1 or par.data_parallel_size > 1 or par.ray_address is not None
    if chosen == "local" and needs_ray:
        if backend == "local":
            raise ValueError(
                "the local backend runs one rank and one replica in this process; "
                f"got tensor_parallel_size={par.world_size}, "
                f"data_parallel_size={par.data_parallel_size}, ray_address={par.ray_address!r}"
            )
        chosen = "ray"  # only the environment asked for local: the config needs Ray
    return chosen


def start_engine(
    config: EngineConfig,
    backend: str | None = None,
    *,
    ready_timeout_s: float = 600.0,
    executor_backend: str = "ray",
) -> EngineClient:
    """An engine running its step loop in the background, behind the ``EngineClient`` API.

    ``executor_backend`` is how a controller actor reaches its workers (``ray`` worker actors,
    or ``local``: the model inside the controller process, tp 1 only -- for tests).
    """
    if resolve_backend(config, backend) == "local":
        tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
        engine = EngineCore(config, LocalExecutor(config), tokenizer=tokenizer)
        return EngineThread(engine, model_name(config))
    from pagedserve.controller.ray_executor import ensure_ray

    # None means a fresh local instance even when a ``ray start`` cluster runs on this machine
    # (plain ``ray.init()`` would attach to that one); "auto" or an address attaches.
    ensure_ray(config.parallel.ray_address)
    return start_controllers(
        config, ready_timeout_s=ready_timeout_s, executor_backend=executor_backend
    )


def start_controllers(
    config: EngineConfig, *, ready_timeout_s: float = 600.0, executor_backend: str = "ray"
) -> EngineClient:
    """Create one controller actor per data-parallel replica (spread over nodes when there are
    several), wait until each is ready, and connect a client to each (Ray must be up)."""
    import ray

    from pagedserve.controller.ray_controller import ControllerActor
    from pagedserve.controller.remote_client import RemoteEngineClient
    from pagedserve.controller.router import Router

    dp = config.parallel.data_parallel_size
    strategy = "SPREAD" if dp > 1 else "DEFAULT"
    actors: list[Any] = [
        ControllerActor.options(scheduling_strategy=strategy).remote(
            config, replica_index=i, executor_backend=executor_backend
        )
        for i in range(dp)
    ]
    clients: list[RemoteEngineClient] = []
    try:
        infos = ray.get([a.info.remote() for a in actors], timeout=ready_timeout_s)
        tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
        for actor, info in zip(actors, infos, strict=True):
            logger.info("replica %d: %s on node %s", info["replica_index"], info["endpoint"],
                        info["node_id"])
            clients.append(
                RemoteEngineClient(
                    info["endpoint"], info, tokenizer=tokenizer, actor=actor, owns_actor=True
                )
            )
    except BaseException as exc:
        for client in clients:
            client.shutdown()
        for actor in actors:
            ray.kill(actor, no_restart=True)
        cause = getattr(exc, "cause", None)  # a RayTaskError carries what the controller raised
        if isinstance(cause, Exception):
            raise cause from None
        raise
    if dp == 1:
        return clients[0]
    return Router(clients, block_size=int(infos[0]["block_size"]))
