"""A thinking model's reasoning, told apart from its answer (``--reasoning-parser``).

Both formats write the reasoning between ``<think>`` and ``</think>``:

- ``qwen3``: the model opens the block itself, so an answer that does not start with
  ``<think>`` has no reasoning;
- ``deepseek_r1``: the chat template opens the block in the prompt, so the answer starts inside
  it (a ``<think>`` the model writes anyway is dropped) and the reasoning runs to ``</think>``.

Reasoning cut short (no ``</think>`` by the end) is all reasoning. ``split`` reads the whole
text generated so far; before the end (``final`` false) a trailing piece that could still
become a marker is held back, so what a stream sends only ever grows.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.serving.tool_parsers import held_back

__all__ = ["REASONING_PARSERS", "ReasoningFormat"]


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    starts_inside: bool
    start: str = "<think>"
    end: str = "</think>"

    def split(self, text: str, final: bool) -> tuple[str, str | None]:
        """``(reasoning so far, the answer's text)``; the answer is None while the reasoning
        goes on."""
        body = text.lstrip()
        if body.startswith(self.start):
            body = body[len(self.start):]
        elif not final and self.start.startswith(body):
            return "", None  # it may still open the block
        elif not self.starts_inside:
            return "", text
        at = body.find(self.end)
        if at >= 0:
            return body[:at], body[at + len(self.end):]
        keep = 0 if final else held_back(body, self.end)
        return body[:len(body) - keep], None


REASONING_PARSERS = {
    "qwen3": ReasoningFormat("qwen3", starts_inside=False),
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_inside=True),
}
