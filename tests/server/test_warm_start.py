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
