"""The server pays its first chat request's lazy cost while it starts: the chat template is
rendered once in ``build_app``."""

from __future__ import annotations


def test_the_server_renders_the_chat_template_once_while_it_starts() -> None:
    from types import SimpleNamespace

    from pagedserve.controller.tokenizer import Tokenizer
    from pagedserve.serving.openai.server import build_app

    rendered: list[tuple[list, bool]] = []

    class HF:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, msgs, add_generation_prompt, tokenize, chat_template=None):
            rendered.append((msgs, add_generation_prompt))
            return "text"

        def encode(self, text, add_special_tokens):
            return [1]

    client = SimpleNamespace(tokenizer=Tokenizer(HF()), model_name="m")
    build_app(client)  # type: ignore[arg-type]
    assert rendered == [([{"role": "user", "content": "Hello"}], True)]


def test_the_event_loop_backend_is_imported_before_the_server_accepts_a_request() -> None:
    """anyio imports its asyncio backend on first use, which would be the first streamed
    answer's task group; the app's lifespan (run by uvicorn before it accepts a connection)
    pays it. A fresh interpreter, so that no earlier test has imported it."""
    import subprocess
    import sys

    code = """
import asyncio, sys
from types import SimpleNamespace
from pagedserve.serving.openai.server import build_app
app = build_app(SimpleNamespace(tokenizer=None, model_name="m"))
backend = "anyio._backends._asyncio"
before = backend in sys.modules
async def start():
    async with app.router.lifespan_context(app):
        return backend in sys.modules
print(before, asyncio.run(start()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]
