"""Tokenizer I/O and incremental detokenization.

The engine core works on token ids; text appears only here. ``transformers`` is imported lazily
(it is heavy), and never pulls torch in for tokenization.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer", "Tokenizer", "load_tokenizer"]

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded together with the first outputs, so tokenizers that drop a leading space
# at the start of a decode (SentencePiece) still render the first generated word correctly.
_PROMPT_CONTEXT_TOKENS = 5


class Tokenizer:
    """A Hugging Face tokenizer plus the EOS ids the engine stops on."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Iterable[int] = ()) -> None:
        self.hf = hf_tokenizer
        eos = set(eos_token_ids)
        if getattr(hf_tokenizer, "eos_token_id", None) is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        # The Rust decoder directly is much cheaper than the transformers wrapper, which matters
        # at two decodes per sequence per step. The wrapper only adds the optional clean-up of
        # spaces before punctuation, so use it only for tokenizers that ask for that.
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        cleanup = getattr(hf_tokenizer, "clean_up_tokenization_spaces", False)
        self._fast_decode = backend.decode if backend is not None and not cleanup else None
        self._control: dict[str, tuple[str, ...]] = {}

    @classmethod
    def from_pretrained(cls, path: str) -> Tokenizer:
        """Load ``AutoTokenizer`` from a checkpoint directory; EOS ids also come from
        ``generation_config.json`` when present (chat models list several there)."""
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(path)
        return cls(hf, eos_ids_from_generation_config(path))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's own chat template (None without one, or a template per name)."""
        template = getattr(self.hf, "chat_template", None)
        return template if isinstance(template, str) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_plain(self, text: str) -> list[int]:
        """``text`` as plain text: no added token, special or not, is recognised in it (what
        a chat message's ``</s>`` must stay). No special tokens are added around it."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:  # a slow tokenizer: its own switch, for the special tokens
            return list(self.hf.encode(text, add_special_tokens=False, split_special_tokens=True))
        # The backend's pipeline without its added-token matching.
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        splits = [text]
        if backend.pre_tokenizer is not None:
            splits = [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
        return [tok.id for piece in splits for tok in backend.model.tokenize(piece)]

    def control_tokens(self, chat_template: str | None) -> tuple[str, ...]:
        """The added tokens only a chat template may write: every special token, and the
        other added tokens its text holds (role markers a tokenizer does not flag as special),
        whitespace tokens aside (templates write those as text)."""
        key = chat_template or ""
        cached = self._control.get(key)
        if cached is None:
            added = getattr(self.hf, "added_tokens_decoder", None) or {}
            tokens = {str(t) for t in getattr(self.hf, "all_special_tokens", ())}
            for tok in added.values():
                text = str(getattr(tok, "content", tok))
                if getattr(tok, "special", False) or (text in key and not text.isspace()):
                    tokens.add(text)
            cached = self._control[key] = tuple(sorted(t for t in tokens if t))
        return cached

    def with_special_tokens(self, token_ids: Sequence[int]) -> list[int]:
        """``token_ids`` with the special tokens ``encode`` adds around a text (BOS, ...)."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        post = getattr(backend, "post_processor", None)
        if post is None:
            build = getattr(self.hf, "build_inputs_with_special_tokens", None)
            return list(build(list(token_ids))) if build is not None else list(token_ids)
        # Where the sequence goes in the template: around one plain token.
        enc = post.process(backend.encode("a", add_special_tokens=False))
        mask = list(enc.special_tokens_mask)
        first, last = mask.index(0), len(mask) - mask[::-1].index(0)
        return [*enc.ids[:first], *token_ids, *enc.ids[last:]]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(token_ids)
        if self._fast_decode is not None:
            return str(self._fast_decode(ids, skip_special_tokens=skip_special_tokens))
        return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))


def eos_ids_from_generation_config(path: str) -> list[int]:
    cfg_path = os.path.join(path, "generation_config.json")
    if not os.path.isfile(cfg_path):
        return []
    with open(cfg_path, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


def load_tokenizer(path: str | None) -> Tokenizer | None:
    """The tokenizer in ``path``, or None when there is no directory holding one."""
    if not path or not os.path.isdir(path):
        return None
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(path, n)) for n in names):
        return None
    return Tokenizer.from_pretrained(path)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas that are always valid UTF-8.

    A byte-level tokenizer may split one character over several tokens; decoding the partial
    bytes yields U+FFFD. We keep a window ``[prefix, read)`` of already-emitted tokens, decode it
    with and without the new tokens, and emit the difference only once the decoded tail no longer
    ends in U+FFFD. Decoding a short window keeps the cost per token constant.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        # The text so far as chunks: appending is O(new), where ``str +=`` copies it all.
        self._chunks: list[str] = []
        self.text_len = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly complete text (possibly empty) and append it."""
        self._ids.extend(new_token_ids)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT_CHAR):
            return ""
        delta = after[len(before) :]
        # Slide the window: what we just emitted becomes the context for the next decode.
        self._prefix = self._read
        self._read = len(self._ids)
        if self._prefix > 4 * _PROMPT_CONTEXT_TOKENS:
            self._trim()
        self._append(delta)
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (the request is finished, so no more bytes will come)."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        delta = after[len(before) :] if len(after) > len(before) else ""
        self._prefix = self._read = len(self._ids)
        self._append(delta)
        return delta

    def _append(self, text: str) -> None:
        if text:
            self._chunks.append(text)
            self.text_len += len(text)

    @property
    def output_text(self) -> str:
        """The whole text so far (joins once; later reads are free until more arrives)."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def text_from(self, start: int) -> str:
        """The text from character ``start`` on: O(what follows ``start``)."""
        tail: list[str] = []
        pos = self.text_len
        for chunk in reversed(self._chunks):
            if pos <= start:
                break
            pos -= len(chunk)
            tail.append(chunk if pos >= start else chunk[start - pos :])
        return "".join(reversed(tail))

    def truncate(self, length: int) -> None:
        """Cut the text to its first ``length`` characters (a stop string matched)."""
        text = self.output_text[:length]
        self._chunks[:] = [text] if text else []
        self.text_len = len(text)

    def _trim(self) -> None:
        # Only ids from ``_prefix`` on are ever decoded again; drop the rest so memory stays flat.
        del self._ids[: self._prefix]
        self._read -= self._prefix
        self._prefix = 0
