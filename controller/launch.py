"""Starting an engine for a front end: resolve the model, build the core, hand back a client."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

from pagedserve.config import EngineConfig
from pagedserve.controller.client import EngineClient, EngineThread
from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.executor import LocalExecutor
from pagedserve.controller.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def resolve_model_dir(model: str | None) -> str:
    """The checkpoint to serve; with none given, the demo checkpoint (written once, cached)."""
    if model:
        return model
    demo = importlib.import_module("pagedserve.workers.demo")
    path = demo.demo_checkpoint_dir()
    logger.warning(
        "no model given: serving the built-in demo checkpoint at %s "
        "(random weights: its output is meaningless)",
        path,
    )
    return str(path)


def model_name(config: EngineConfig) -> str:
    """The name clients address the model by: the checkpoint directory's name."""
    return Path(config.model.model).name or config.model.model


def start_engine(config: EngineConfig) -> EngineClient:
    """An engine running its step loop in the background, behind the ``EngineClient`` API."""
    tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
    engine = EngineCore(config, LocalExecutor(config), tokenizer=tokenizer)
    return EngineThread(engine, model_name(config))
