"""The composition root: the one place that names the workers, and builds engines from configs.

``build_engine`` makes an ``EngineCore`` over an in-process worker (``executor="local"``) or
over Ray worker actors in a given placement group (``executor="ray"``); ``start_engine`` gives
a front end a running engine behind the ``EngineClient`` API, in this process (backend
``local``: an ``EngineLoop`` thread, no Ray) or as Ray controller actors (backend ``ray``, the
default: a local Ray instance starts unless ``ray_address`` names a cluster).
``PAGEDSERVE_BACKEND`` (``ray`` / ``local``) overrides the default when no backend is passed.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

from pagedserve.config import EngineConfig
from pagedserve.controller.client import EngineClient, LocalEngineClient
from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.executor import Executor, LocalExecutor
from pagedserve.controller.loop import EngineLoop
from pagedserve.controller.tokenizer import load_tokenizer

__all__ = [
    "BACKEND_ENV",
    "build_engine",
    "make_executor",
    "model_name",
    "resolve_backend",
    "resolve_model_dir",
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
    from pagedserve.workers.checkpoints import prepare_checkpoint

    return str(prepare_checkpoint(model))


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


def make_executor(
    config: EngineConfig, executor: str = "local", placement_group: Any = None, **options: Any
) -> Executor:
    """``local``: one in-process worker (tensor_parallel_size 1 only); ``ray``: worker actors in
    ``placement_group`` (Ray must be up). ``options`` go to the executor's constructor."""
    if executor == "local":
        tp = config.parallel.world_size
        if tp != 1:
            raise ValueError(f"the local executor runs one rank; the config has {tp} ranks")
        from pagedserve.workers.worker import Worker

        return LocalExecutor(functools.partial(Worker, config, rank=0), **options)
    if executor == "ray":
        from pagedserve.cluster.ray_executor import RayExecutor
        from pagedserve.workers.ray_worker import RayWorker

        if placement_group is None:
            raise ValueError("the Ray executor needs the worker group's placement group")
        return RayExecutor(config, placement_group, RayWorker, **options)
    raise ValueError(f"unknown executor {executor!r}; use 'ray' or 'local'")


def build_engine(
    config: EngineConfig, placement_group: Any = None, *, executor: str | None = None,
    **engine_options: Any,
) -> EngineCore:
    """An ``EngineCore`` with its tokenizer; the executor is ``ray`` when a placement group is
    given, else ``local``, unless named."""
    chosen = executor or ("ray" if placement_group is not None else "local")
    tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
    return EngineCore(
        config, make_executor(config, chosen, placement_group), tokenizer=tokenizer,
        **engine_options,
    )


def start_engine(
    config: EngineConfig,
    backend: str | None = None,
    *,
    ready_timeout_s: float = 600.0,
    executor: str = "ray",
) -> EngineClient:
    """An engine running its loop in the background, behind the ``EngineClient`` API.

    ``executor`` is how a Ray controller reaches its workers (``ray`` worker actors, or
    ``local``: the model inside the controller process, one rank only -- for tests).
    """
    if resolve_backend(config, backend) == "local":
        # Built on the loop's thread, which then runs every step (see EngineLoop).
        return LocalEngineClient(EngineLoop(lambda: build_engine(config)), model_name(config))
    from pagedserve.cluster.launch import ensure_ray, start_controllers

    # None means a fresh local instance even when a ``ray start`` cluster runs on this machine
    # (plain ``ray.init()`` would attach to that one); "auto" or an address attaches.
    ensure_ray(config.parallel.ray_address)
    build = functools.partial(build_engine, executor=executor)
    return start_controllers(
        config, build, model_name=model_name(config), reserve_workers=executor == "ray",
        ready_timeout_s=ready_timeout_s,
    )
