"""Stop strings, matched at a cost per step independent of how many there are.

A request may carry thousands of stop strings (the HTTP server bounds them; the engine does not
rely on that). Each step appends a few characters to a sequence's text, and a stop string that
completes in this step ends inside them. So for each new end position it is enough to look up,
for each distinct stop length, the one slice of that length ending there: the work per new
character is O(distinct lengths), never O(stop strings), and it is built once per request and
shared by its ``n`` sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopStrings"]


class StopStrings:
    """The stop strings of one request, indexed by length."""

    __slots__ = ("_lengths", "_rank", "longest")

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or not all(stops):
            raise ValueError("stop strings must be a non-empty list of non-empty strings")
        # The position in the request's list breaks ties between matches starting together.
        self._rank: dict[str, int] = {}
        for i, s in enumerate(stops):
            self._rank.setdefault(s, i)
        self._lengths = sorted({len(s) for s in self._rank})
        self.longest = self._lengths[-1]
        """The longest stop's length: the text's last ``longest - 1`` characters may still
        become the start of a match, so they are held back from the client."""

    def find(self, text: str, new_chars: int) -> tuple[int, str] | None:
        """``(start, stop)`` of the match that ends within the last ``new_chars`` characters
        of ``text`` and starts first (the one listed first among those starting together),
        or None. ``text`` needs only the ``longest - 1`` characters before the new ones."""
        size = len(text)
        best: tuple[int, int, int] | None = None  # (start, rank, length)
        for end in range(max(1, size - new_chars + 1), size + 1):
            for length in self._lengths:
                start = end - length
                if start < 0:
                    break  # the lengths ascend: every later one starts before the text
                rank = self._rank.get(text[start:end])
                if rank is not None and (best is None or (start, rank) < best[:2]):
                    best = (start, rank, length)
        if best is None:
            return None
        start, _, length = best
        return start, text[start : start + length]
