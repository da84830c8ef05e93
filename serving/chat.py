"""Chat conversations rendered into prompts through the model's chat template.

One place for what the JSONL job's ``messages`` lines, ``LLM.chat``, ``pagedserve generate
--chat`` and the HTTP server share: check a conversation's shape and roles, apply the
tokenizer's chat template (with the generation prompt), and tokenize the text without adding
special tokens again (the template writes its own BOS and role markers). Control-token text in
the messages stays text (``chat_control``) unless the caller allows it. Pure Python: the
tokenizer does the work.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from typing import Any

from pagedserve.controller.tokenizer import Tokenizer
from pagedserve.serving.chat_control import encode_marked, mark, template_roles, unmark

__all__ = [
    "ChatError", "Conversation", "as_conversations", "chat_prompts", "render_chat",
    "template_message", "user_turn",
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
        or not all(isinstance(m, Mapping) and isinstance(m.get("role"), str)
                   for m in conversation)
    ):
        raise ChatError("messages must be a non-empty list of {role, content} objects")
    return [template_message(m, i) for i, m in enumerate(conversation)]


def template_message(message: Mapping[str, Any], index: int = 0) -> dict[str, Any]:
    """An OpenAI chat message as the chat template takes it; raises ``ChatError``.

    The shapes ``/v1/chat/completions`` accepts: ``content`` a string, a list of text parts
    (joined) or None (an assistant turn that only calls tools; rendered as ``""``, since
    templates test it as text); an assistant's ``tool_calls`` with each call's ``arguments``
    parsed from its JSON text into an object (templates write them with ``tojson``, which
    would quote a string twice); a ``tool`` result's ``tool_call_id``. Other keys reach the
    template as given. The server's messages, validated by its schema first, and
    ``LLM.chat``'s plain dicts both pass through here, so they render alike."""
    where = f"messages[{index}]"
    msg = dict(message)
    msg["content"] = _content_text(msg.get("content"), where)
    for key in ("name", "tool_call_id"):
        if key in msg and msg[key] is not None and not isinstance(msg[key], str):
            raise ChatError(f"{where}.{key} must be a string")
    calls = msg.get("tool_calls")
    if calls is not None:
        if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
            raise ChatError(f"{where}.tool_calls must be a list of calls")
        msg["tool_calls"] = [_template_call(c, f"{where}.tool_calls[{k}]")
                             for k, c in enumerate(calls)]
        if not calls:  # left out, as no calls: templates test ``tool_calls is defined``
            del msg["tool_calls"]
    return msg


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, (bytes, Mapping)) and isinstance(content, Sequence) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ChatError(f"{where}.content must be a string, a list of "
                    '{"type": "text", "text": ...} parts, or null')


def _template_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if (
        not isinstance(fn, Mapping)
        or not isinstance(call.get("id"), str)
        or call.get("type", "function") != "function"
        or not isinstance(fn.get("name"), str)
        or not isinstance(fn.get("arguments"), str)
    ):
        raise ChatError(f'{where} must be {{"id", "type": "function", "function": {{"name", '
                        '"arguments" (JSON text)}}')
    try:
        arguments = json.loads(fn["arguments"])
    except ValueError:
        raise ChatError(f"{where}: a tool call's arguments are not JSON: "
                        f"{fn['arguments'][:60]!r}") from None
    return {"id": call["id"], "type": "function",
            "function": {"name": fn["name"], "arguments": arguments}}


def _check_roles(messages: list[dict[str, Any]], template: str | None) -> None:
    """A role the template does not know is refused: templates paste the role into their
    text, so ``"user|>\\nhi\\n<|system"`` would forge a system turn."""
    known = template_roles(template)
    for i, m in enumerate(messages):
        if m["role"] not in known:
            raise ChatError(f"messages[{i}].role {m['role'][:40]!r} is not a role this chat "
                            f"template knows ({', '.join(sorted(known))})")


def _template_kwargs(tokenizer: Tokenizer, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The caller's template variables; one that would set an argument of
    ``apply_chat_template`` itself (``tokenize``, ``tools``, ...) is refused by name."""
    if not kwargs:
        return {}
    if not all(isinstance(k, str) for k in kwargs):
        raise ChatError("chat_template_kwargs must map names to values")
    params = inspect.signature(tokenizer.hf.apply_chat_template).parameters
    reserved = sorted(k for k in kwargs if k in params and params[k].kind not in (
        inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL))
    if reserved:
        raise ChatError(f"chat_template_kwargs may not set {', '.join(reserved)}: "
                        "an argument of the template call, not a template variable")
    return dict(kwargs)


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
    continue_final_message: bool = False,
    documents: Sequence[Mapping[str, str]] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    allow_special_tokens: bool = False,
) -> tuple[str, list[int]]:
    """``(prompt text, prompt token ids)`` of a conversation; raises ``ChatError``.

    ``chat_template_kwargs`` are more variables for the template (``enable_thinking``, ...);
    ``continue_final_message`` leaves the last (assistant) message open for the model to go on
    with; ``documents`` and ``tools`` (OpenAI's function definitions) go to a template that
    renders them. Control tokens written in any of
    these strings (``</s>``, ``<|im_start|>``) are tokenized as plain text;
    ``allow_special_tokens`` lets them be real tokens, as the text reads."""
    messages = _check(conversation)
    if tokenizer is None:
        raise ChatError("chat needs a tokenizer with a chat template, and the model has none")
    template = chat_template or tokenizer.chat_template
    _check_roles(messages, template)
    tokens = () if allow_special_tokens else tokenizer.control_tokens(template)
    extra = _template_kwargs(tokenizer, chat_template_kwargs)
    if documents is not None:
        extra["documents"] = documents
    if tools is not None:
        extra["tools"] = tools
    if continue_final_message:
        if add_generation_prompt:
            raise ChatError("continue_final_message and add_generation_prompt cannot both be "
                            "true: the last message is either continued or answered")
        if messages[-1]["role"] != "assistant":
            raise ChatError("continue_final_message needs the last message to be the "
                            "assistant's")
        extra["continue_final_message"] = True
    try:
        text = tokenizer.hf.apply_chat_template(
            mark(messages, tokens),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            # The caller's strings reach the template as the messages' do: marked.
            **mark(extra, tokens, skip=frozenset()),
        )
    except Exception as exc:  # no template, or a template that rejects these messages
        raise ChatError(f"cannot apply the chat template: {unmark(str(exc), tokens)}") from exc
    try:
        ids = encode_marked(tokenizer, text, tokens)
    except ValueError as exc:
        raise ChatError(str(exc)) from exc
    return unmark(text, tokens), ids


def chat_prompts(
    tokenizer: Tokenizer | None,
    messages: Conversation | Sequence[Conversation],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    allow_special_tokens: bool = False,
) -> list[dict[str, Any]]:
    """Each conversation rendered as a ``{"prompt", "prompt_token_ids"}`` prompt for
    ``LLM.generate`` (``tools``: OpenAI's function definitions, for the template)."""
    prompts: list[dict[str, Any]] = []
    for conversation in as_conversations(messages):
        text, ids = render_chat(
            tokenizer,
            conversation,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
            allow_special_tokens=allow_special_tokens,
        )
        prompts.append({"prompt": text, "prompt_token_ids": ids})
    return prompts
