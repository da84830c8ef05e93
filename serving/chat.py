"""Chat conversations rendered into prompts through the model's chat template.

One place for what the JSONL job's ``messages`` lines, ``LLM.chat`` and ``pagedserve generate
--chat`` share: check a conversation's shape, apply the tokenizer's chat template (with the
generation prompt), and tokenize the text without adding special tokens again (the template
writes its own BOS and role markers). Pure Python: the tokenizer does the work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedserve.controller.tokenizer import Tokenizer

__all__ = [
    "ChatError", "Conversation", "as_conversations", "chat_prompts", "render_chat", "user_turn",
]

Conversation = Sequence[Mapping[str, Any]]


class ChatError(ValueError):
    """A conversation that is malformed, or that the chat template cannot render."""


def user_turn(text: str, system: str | None = None) -> list[dict[str, str]]:
    """A one-question conversation, with an optional system message first."""
    turn = [{"role": "user", "content": text}]
    return [{"role": "system", "content": system}, *turn] if system is not None else turn


def _check(conversation: Any) -> list[dict[str, Any]]:
    if (
        isinstance(conversation, (str, bytes))
        or not isinstance(conversation, Sequence)
        or not conversation
        or not all(
            isinstance(m, Mapping)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in conversation
        )
    ):
        raise ChatError("messages must be a non-empty list of {role, content} string objects")
    return [dict(m) for m in conversation]


def as_conversations(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    """One conversation (a list of messages) or a list of them, as a list of conversations."""
    if (
        isinstance(messages, Sequence)
        and not isinstance(messages, (str, bytes))
        and messages
        and all(isinstance(m, Mapping) for m in messages)
    ):
        return [messages]  # type: ignore[list-item]
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatError("messages must be a conversation (a list of {role, content} objects) "
                        "or a non-empty list of conversations")
    return list(messages)  # type: ignore[arg-type]


def render_chat(
    tokenizer: Tokenizer | None,
    conversation: Conversation,
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[str, list[int]]:
    """``(prompt text, prompt token ids)`` of a conversation; raises ``ChatError``."""
    messages = _check(conversation)
    if tokenizer is None:
        raise ChatError("chat needs a tokenizer with a chat template, and the model has none")
    try:
        text = tokenizer.hf.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            **dict(chat_template_kwargs or {}),
        )
    except Exception as exc:  # no template, or a template that rejects these messages
        raise ChatError(f"cannot apply the chat template: {exc}") from exc
    return text, list(tokenizer.hf.encode(text, add_special_tokens=False))


def chat_prompts(
    tokenizer: Tokenizer | None,
    messages: Conversation | Sequence[Conversation],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Each conversation rendered as a ``{"prompt", "prompt_token_ids"}`` prompt for
    ``LLM.generate``."""
    prompts: list[dict[str, Any]] = []
    for conversation in as_conversations(messages):
        text, ids = render_chat(
            tokenizer,
            conversation,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        prompts.append({"prompt": text, "prompt_token_ids": ids})
    return prompts
