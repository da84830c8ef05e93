"""Fixtures for the HTTP server tests: one tiny checkpoint per session, engines per module,
and real uvicorn servers on free ports of 127.0.0.1, each in a background thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers.checkpoints import make_checkpoint

    return make_checkpoint("llama", tmp_path_factory.mktemp("server") / "tiny-llama")


def _start_client(model_dir: Path, **options: Any) -> Any:
    """An in-process client (no Ray: fast, and tests may reach into its engine)."""
    from pagedserve.builder import start_engine
    from pagedserve.config import from_flat

    options.setdefault("kv_cache_memory_bytes", 1 << 22)
    options.setdefault("max_model_len", 256)
    return start_engine(from_flat(model=str(model_dir), **options), "local")


@contextlib.contextmanager
def _running(app: Any) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free port; yield its base URL; stop it afterwards."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


def _with_chat_template(model_dir: Path, dest: Path, template: str) -> Path:
    """A copy of the checkpoint at ``model_dir`` in ``dest``, with ``template`` as its
    tokenizer's chat template."""
    import json
    import shutil

    shutil.copytree(model_dir, dest)
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    return dest


@contextlib.contextmanager
def _openai(
    model_dir: Path, app: dict[str, Any] | None = None, **options: Any
) -> Iterator[SimpleNamespace]:
    """An engine on ``model_dir`` (engine ``options``) behind a real server (``build_app``'s
    ``app`` options), with an ``openai`` client for it: ``client``, ``oai``, ``model`` (its
    name) and ``url``."""
    from openai import OpenAI

    from pagedserve.serving.openai.server import build_app

    client = _start_client(model_dir, **options)
    try:
        with _running(build_app(client, **(app or {}))) as url:
            oai = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            yield SimpleNamespace(client=client, oai=oai, model=client.model_name, url=url)
            oai.close()
    finally:
        client.shutdown()


@pytest.fixture(scope="session")
def srv() -> SimpleNamespace:
    """Helpers (test modules cannot import conftest under importlib mode)."""
    return SimpleNamespace(start_client=_start_client, running=_running, wait_until=wait_until,
                           openai=_openai, with_chat_template=_with_chat_template)


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()
