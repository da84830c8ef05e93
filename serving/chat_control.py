"""Chat templates get data, not control: control-token text in a message stays text.

A chat template writes its own control tokens (BOS, role markers, end-of-turn); the strings of
the messages it is given are data. Rendering the template and tokenizing the result as one
text loses that line: a message holding ``</s><s>`` would become real EOS and BOS tokens. So
before rendering, every control token found in a message's strings is wrapped in markers (two
private-use characters around a per-process nonce, which no client sees); after rendering,
the text is split at the markers, the marked tokens are encoded as plain text and the rest as
usual (the template's own control tokens are recognised there, and only there). A message
without control-token text is not changed at all, so its prompt is exactly what it was.

Templates that cut strings (``split``, slicing) may separate a marker from its token: a lone
marker is dropped, and still splits the text so that the pieces on either side cannot join
into a control token. Roles are checked separately (``template_roles``): a template that
pastes the role into its text (``<|{{ role }}|>``) would otherwise take any markup from it.
"""

from __future__ import annotations

import re
import secrets
from functools import lru_cache
from typing import Any

from pagedserve.controller.tokenizer import Tokenizer

__all__ = ["STANDARD_ROLES", "encode_marked", "mark", "template_roles", "unmark"]

STANDARD_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})

_NONCE = secrets.token_hex(8)
_START = f"\ue000{_NONCE}\ue001"
_END = f"\ue002{_NONCE}\ue003"

_ROLE_NAME = r"[A-Za-z][\w-]{0,31}"
# ``message['role'] == 'user'``, ``message.role != "tool"``, ``role == 'ipython'``
_ROLE_COMPARE = re.compile(rf"""role['"]?\]?\s*[!=]=\s*(['"])({_ROLE_NAME})\1""")
# ``message['role'] in ['user', 'system']`` (or a tuple)
_ROLE_IN = re.compile(r"""role['"]?\]?\s+(?:not\s+)?in\s*[\[(]([^\])]{0,400})[\])]""")
_QUOTED_NAME = re.compile(rf"""(['"])({_ROLE_NAME})\1""")


@lru_cache(maxsize=64)
def template_roles(template: str | None) -> frozenset[str]:
    """The roles a chat message may have: the standard ones, and those the template itself
    compares a message's role with (``ipython``, ``function``, ...)."""
    roles = set(STANDARD_ROLES)
    if template:
        roles.update(m.group(2) for m in _ROLE_COMPARE.finditer(template))
        for group in _ROLE_IN.finditer(template):
            roles.update(m.group(2) for m in _QUOTED_NAME.finditer(group.group(1)))
    return frozenset(roles)


def _trie(words: list[str]) -> str:
    """A regex matching any of ``words``, the longest at a position first, built as a trie:
    an alternation of 250 literals costs a try of each at every position of a long text
    (seconds on 20 MB of ``<``), a trie a character or two."""
    root: dict[str, Any] = {}
    for word in words:
        node = root
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def pattern(node: dict[str, Any]) -> str:
        alts = [re.escape(ch) + pattern(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body  # greedy: the longer word first

    return pattern(root)


@lru_cache(maxsize=16)
def _patterns(tokens: tuple[str, ...]) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """(any control token; a marked token or a lone marker)."""
    words = [t for t in tokens if t]
    control = re.compile(_trie(words) if words else "(?!)")  # (?!) never matches
    start, end = re.escape(_START), re.escape(_END)
    return control, re.compile(f"{start}({control.pattern}){end}|{start}|{end}")


def mark(obj: Any, tokens: tuple[str, ...], skip: frozenset[str] = frozenset({"role"})) -> Any:
    """``obj`` (messages: strings, lists and dicts, recursively) with every control token in
    its strings wrapped in markers; dict keys, and the values of keys in ``skip``, as they are.
    """
    if not tokens:
        return obj
    control, _ = _patterns(tokens)
    wrap = f"{_START}\\g<0>{_END}"

    def walk(value: Any) -> Any:
        if isinstance(value, str):
            return control.sub(wrap, value)
        if isinstance(value, dict):
            return {k: v if k in skip else walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v) for v in value]
        return value

    return walk(obj)


def unmark(text: str, tokens: tuple[str, ...]) -> str:
    """The rendered text as the model reads it: markers gone, marked tokens left as text."""
    if not tokens:
        return text
    return _patterns(tokens)[1].sub(lambda m: m.group(1) or "", text)


def encode_marked(tokenizer: Tokenizer, text: str, tokens: tuple[str, ...]) -> list[int]:
    """Token ids of a chat rendered from ``mark``ed messages: marked tokens as plain text, the
    rest as the tokenizer encodes it (the template's control tokens included). Raises
    ``ValueError`` when the tokenizer would make a control token out of plain text."""
    encode = tokenizer.hf.encode
    if not tokens:
        return list(encode(text, add_special_tokens=False))
    # [text, marked token or None (a lone marker), text, ...]
    pieces = _patterns(tokens)[1].split(text)
    ids = list(encode(pieces[0], add_special_tokens=False))
    newline = list(encode("\n", add_special_tokens=False))
    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:
            continue
        plain = i % 2 == 1
        piece_ids = _encode_inside(tokenizer, piece, plain, newline)
        if plain and tokenizer.hf.convert_tokens_to_ids(piece) in piece_ids:
            raise ValueError(f"cannot keep {piece!r} as text: this tokenizer makes the token "
                             "out of plain text")
        ids += piece_ids
    return ids


def _encode_inside(tokenizer: Tokenizer, piece: str, plain: bool, newline: list[int]) -> list[int]:
    """Encode a piece from the middle of a text. Encoded after a newline, which is then taken
    off again: a SentencePiece tokenizer adds a prefix space at the start of a text, and this
    piece is not at the start."""
    def encode(s: str) -> list[int]:
        if plain:
            return tokenizer.encode_plain(s)
        return list(tokenizer.hf.encode(s, add_special_tokens=False))

    ids = encode("\n" + piece)
    return ids[len(newline):] if ids[:len(newline)] == newline else encode(piece)
