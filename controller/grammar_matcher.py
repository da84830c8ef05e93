"""One sequence's grammar matcher: what it may sample next, and the tokens it has taken.
Its own module so that ``Request``, which holds one, and the gate, which makes them, do not
import each other.

A sequence that runs out of tokens inside its grammar (a string the model never ends, digits
that run on) would end at ``max_tokens`` with a document the client cannot parse. So once the
tokens left come within a slack (``CLOSING_SLACK``) of what it takes to complete the grammar
from where the sequence stands, the matcher stops offering choices and forces a completion: the open
string is closed, required properties get small values, open brackets close. The completion
comes from a greedy walk over the grammar (``GrammarCloser``), short but not always the
shortest. The client gets a document that follows its constraint, with ``finish_reason``
``length``, since the budget ended it, not the model (``stop`` where the grammar forced every
byte of the completion anyway).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any, NamedTuple

__all__ = ["CLOSING_SLACK", "Closing", "GrammarCloser", "SequenceGrammar"]

CLOSING_SLACK = 16
"""Tokens kept in hand when the closing starts: one sampled token can open what takes several
more to close (a quote, a nested object with required properties), so the closing is forced
while it still fits after that. A sequence with a small budget keeps an eighth of it (at least
2): at ``max_tokens`` 16 a slack of 16 would leave the model nothing to write."""

# The bytes a closing walk tries, in order: closers first, so that an open string, object, array
# or group ends as soon as the grammar lets it; then separators, the smallest values, the rest
# of printable ASCII and a line break, and last the continuation bytes that end a character the
# sampler left half written.
_CLOSERS = b'"}])>'
_CLOSING_ORDER = (_CLOSERS + b",:.0123456789-_@#+ abcdefghijklmnopqrstuvwxyz"
                  + b"ABCDEFGHIJKLMNOPQRSTUVWXYZ{[!$%&'(*/;<=?\\^`|~\n" + bytes(range(0x80, 0xC0)))
_UNCOUNTED = _CLOSERS + b":"
_SPACE = ord(" ")
_RECENT = 32  # bytes: how far back the walk counts what it wrote
_MAX_CLOSING = 512  # bytes; a grammar that needs more is left to run out


class Closing(NamedTuple):
    """A completion of a grammar, and whether the walk chose anything in it (False when the
    grammar forced every byte: the sequence had nothing else to write)."""

    tokens: list[int]
    chosen: bool


class GrammarCloser:
    """Finds a short completion of a grammar from a matcher's state, as tokens. Built once per
    tokenizer, from its ``tokenize`` (bytes to token ids), EOS token and vocabulary size."""

    def __init__(self, tokenize: Callable[[bytes], list[int]], eos: int | None,
                 vocab_size: int) -> None:
        # The walk writes a byte a token: those of the closing order that are one.
        self._order = [(b, ids[0]) for b in _CLOSING_ORDER
                       if len(ids := tokenize(bytes([b]))) == 1]
        self._tokenize = tokenize
        self._eos = eos
        self.row_bytes = 4 * ((vocab_size + 31) // 32)
        """A mask row's length: one bit a token, in int32 words (as the matcher's)."""

    def closing(self, m: Any) -> Closing | None:
        """A completion of the grammar from ``m``'s state (the matcher is left as it was),
        ending with EOS where the grammar needs one to stop; None when the walk finds none
        within ``_MAX_CLOSING`` bytes."""
        text = bytearray()
        tokens: list[int] = []
        chosen = False
        try:
            while not (m.is_stopped() or m.is_accepting()):
                if len(text) >= _MAX_CLOSING:
                    return None
                # Bytes the grammar forces (a key's name, the rest of a literal) in one go.
                if forced := m.compute_ff_bytes():
                    ids = self._tokenize(forced)
                    if (taken := m.try_consume_tokens(ids)) == len(ids):
                        text += forced
                        tokens += ids
                        continue
                    m.rollback(taken)  # a split the grammar refuses: a byte at a time
                step = self._next_byte(m, text)
                if step is None:
                    return None
                chosen |= not forced or step[0] != forced[0]
                m.consume_token(step[1])
                text.append(step[0])
                tokens.append(step[1])
            needs_eos = not m.is_stopped()
        finally:
            if tokens:
                m.rollback(len(tokens))
        # One token a byte is the walk's; the tokenizer's own split of the same text is
        # shorter and reaches the same state (the grammar reads bytes, not tokens).
        joined = list(self._tokenize(bytes(text)))
        if len(joined) < len(tokens) and m.validate_tokens(joined) == len(joined):
            tokens = joined
        if needs_eos:  # the grammar would take more: ending here is a choice too
            if self._eos is None:
                return None
            tokens.append(self._eos)
        return Closing(tokens, chosen or needs_eos)

    def _next_byte(self, m: Any, text: bytearray) -> tuple[int, int] | None:
        """The first byte of the closing order the grammar takes next, those the walk wrote
        lately moved back by how often: a loop such as ``[0-9]+-`` or ``item ("," item)* ";"``
        moves on to its dash or semicolon instead of going round. A punctuation byte repeats
        once before it counts (``\\d+\\.\\d+\\.\\d+`` takes its second dot); closers and colons
        never count, and a space always goes last."""
        moved_back = {}
        for b, n in Counter(text[-_RECENT:]).items():
            if b not in _UNCOUNTED and (n := n if bytes([b]).isalnum() else n - 1) > 0:
                moved_back[b] = n
        moved_back[_SPACE] = _RECENT  # after the count, which would lower it
        order = chain((bt for bt in self._order if bt[0] not in moved_back),
                      sorted((bt for bt in self._order if bt[0] in moved_back),
                             key=lambda bt: moved_back[bt[0]]))
        return next((bt for bt in order if m.validate_tokens([bt[1]])), None)


class SequenceGrammar:
    """One sequence's matcher: it has consumed exactly the sequence's output tokens."""

    __slots__ = ("_closer", "_forced", "_matcher", "_next_look", "_slack", "closed_by_budget")

    def __init__(self, matcher: Any, closer: GrammarCloser | None = None) -> None:
        self._matcher = matcher
        self._closer = closer
        self._forced: list[int] = []
        """The completion being forced, from the next token on."""
        self._next_look: int | None = None
        """The budget at or under which to look for the closing again (None: at once)."""
        self._slack: int | None = None
        """``CLOSING_SLACK``, or less for a small budget; set by the first look."""
        self.closed_by_budget = False
        """The budget ran short and the grammar was completed by force, with choices the
        model did not make (not when the grammar forced every byte of the completion)."""

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it."""
        if self._forced:
            # A forced token is the only one its mask allowed; anything else (a draft's
            # bonus token past the closing) ends the forcing, and the grammar judges it.
            self._forced = self._forced[1:] if self._forced[0] == token_id else []
        return bool(self._matcher.consume_token(token_id))

    @property
    def stopped(self) -> bool:
        """The grammar is complete and admits nothing more: the sequence ends here."""
        return bool(self._matcher.is_stopped())

    def masks(self, drafts: list[int], budget: int | None = None) -> bytes:
        """The allowed tokens of the next position and of each draft's (rows of int32 words),
        the drafts consumed tentatively and rolled back. Past a draft the grammar refuses,
        rows allow everything: that draft is rejected, so the positions after it are unused.

        ``budget`` is how many tokens the sequence may still add, this step's included; near
        its end the grammar's completion is forced (the module's docstring)."""
        m = self._matcher
        if budget is not None:
            self._start_closing(budget)
        if self._forced:
            return self._forced_masks(drafts)
        rows = [m.compute_bitmask()]
        # validate_tokens first: consuming a refused token would leave the matcher in its
        # error state, which rollback does not undo.
        valid = m.validate_tokens(drafts) if drafts else 0
        for token in drafts[:valid]:
            m.consume_token(token)
            rows.append(m.compute_bitmask())
        rows.extend([b"\xff" * len(rows[0])] * (len(drafts) - valid))
        if valid:
            m.rollback(valid)
        return b"".join(rows)

    def _start_closing(self, budget: int) -> None:
        """Force the closing once it takes all but the slack (``CLOSING_SLACK``) of the tokens
        left.

        Each look walks the grammar, so a sequence looks when it starts and then again when
        half its distance to that point is spent: the closing would have to grow by more than
        a token for each token written to overtake it, and the slack covers a step's worth
        of that. Where the walk finds no closing (one past ``_MAX_CLOSING`` bytes, say: a
        thousand required items), the sequence does not look again and is left to run out."""
        if self._closer is None or self._forced or self.stopped or (
                self._next_look is not None and budget > self._next_look):
            return
        if self._slack is None:
            self._slack = min(CLOSING_SLACK, max(2, budget // 8))
        closing = self._closer.closing(self._matcher)
        if closing is None:
            self._next_look = 0
            return
        if (distance := budget - len(closing.tokens) - self._slack) > 0:
            self._next_look = budget - max(1, distance // 2)
        else:
            self._forced = closing.tokens
            self.closed_by_budget = closing.chosen

    def _forced_masks(self, drafts: Sequence[int]) -> bytes:
        """Rows that allow only the forced token at each position the drafts keep on the
        forced path; a position after a draft off it allows everything (unused)."""
        assert self._closer is not None  # only a closer's walk forces anything
        row_bytes = self._closer.row_bytes
        rows = []
        for i in range(len(drafts) + 1):
            on_path = i < len(self._forced) and list(drafts[:i]) == self._forced[:i]
            rows.append(_one_token_row(self._forced[i], row_bytes) if on_path
                        else b"\xff" * row_bytes)
        return b"".join(rows)


def _one_token_row(token_id: int, row_bytes: int) -> bytes:
    """A mask row (little-endian int32 words, bit ``t % 32`` of word ``t // 32``) that allows
    ``token_id`` alone: that is byte ``t // 8``, bit ``t % 8``."""
    row = bytearray(row_bytes)
    row[token_id // 8] = 1 << (token_id % 8)
    return bytes(row)
