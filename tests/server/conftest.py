"""Fixtures for the HTTP server tests: one tiny checkpoint per session, engines per module
(and one per session for the tool-calling modules, ``hermes_server``), and real uvicorn
servers on free ports of 127.0.0.1, each in a background thread."""

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


HERMES_TEMPLATE = (
    # The tools in short: the tiny model's tokens are about a character each.
    "{{ bos_token }}{% if tools %}<|system|>\n{% for t in tools %}{{ t['function']['name'] }}("
    "{{ t['function']['parameters']['required'] | join(', ') }}): "
    "{{ t['function']['description'] }}\n{% endfor %}Call as <tool_call>{json}</tool_call>\n"
    "{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|tool|>\n[{{ m['tool_call_id'] }}] "
    "{{ m['content'] }}\n{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="session")
def hermes_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[SimpleNamespace]:
    """The tiny Llama given a chat template that renders tools and writes calls as Hermes
    does, behind a server (``_openai``'s namespace, with ``http``, an ``httpx`` client): one
    per session for the chat tool-call and Responses tests."""
    import httpx

    model = _with_chat_template(llama_dir, tmp_path_factory.mktemp("hermes") / "model",
                                HERMES_TEMPLATE)
    with _openai(model, max_model_len=512) as env, \
            httpx.Client(base_url=env.url, timeout=60) as http:
        env.http = http
        yield env


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
