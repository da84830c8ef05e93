"""One sequence's grammar matcher: what it may sample next, and the tokens it has taken.
Its own module so that ``Request``, which holds one, and the gate, which makes them, do not
import each other."""

from __future__ import annotations

from typing import Any

__all__ = ["SequenceGrammar"]


class SequenceGrammar:
    """One sequence's matcher: it has consumed exactly the sequence's output tokens."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def stopped(self) -> bool:
        """The grammar is complete and admits nothing more: the sequence ends here."""
        return bool(self._matcher.is_stopped())

    def masks(self, drafts: list[int]) -> bytes:
        """The allowed tokens of the next position and of each draft's (rows of int32 words),
        the drafts consumed tentatively and rolled back. Past a draft the grammar refuses,
        rows allow everything: that draft is rejected, so the positions after it are unused."""
        m = self._matcher
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
