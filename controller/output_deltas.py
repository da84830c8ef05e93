"""The two halves of ``OutputBatch``'s delta format (see ``messages.OutputBatch``).

Sinks get cumulative outputs, but sending every request's whole output each step would make a
long generation cost O(length^2) bytes on the wire. So the controller sends only what is new
(``OutputDeltas``) and each client rebuilds the cumulative output (``OutputMerger``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.messages import CompletionOutput, RequestOutput

__all__ = ["OutputDeltas", "OutputMerger"]

Sink = Callable[[RequestOutput], None]


class OutputDeltas:
    """Controller half: cumulative ``RequestOutput``s in, ``OutputBatch`` deltas out."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, tuple[int, str]]] = {}

    def delta(self, out: RequestOutput, key: str) -> tuple[RequestOutput, list[int]]:
        sent = self._sent.setdefault(key, {})
        comps: list[CompletionOutput] = []
        starts: list[int] = []
        for c in out.outputs:
            n_tok, text = sent.get(c.index, (0, ""))
            if c.text.startswith(text):
                start = len(text)
            else:  # a stop string cut text already sent: resend from the common prefix
                start = len(os.path.commonprefix([text, c.text]))
            logprobs = c.logprobs[n_tok:] if c.logprobs is not None else None
            comps.append(
                CompletionOutput(
                    c.index, c.text[start:], c.token_ids[n_tok:], c.finish_reason,
                    c.stop_reason, logprobs, c.cumulative_logprob,
                )
            )
            starts.append(start)
            sent[c.index] = (len(c.token_ids), c.text)
        if out.finished:
            del self._sent[key]
        # The client kept the prompt when it sent the request: it never travels back.
        delta = RequestOutput(
            out.request_id, None, [], comps, out.finished, out.num_cached_tokens, out.error
        )
        return delta, starts

    def forget(self, key: str) -> None:
        self._sent.pop(key, None)


@dataclass(slots=True)
class OutputMerger:
    """Client half: one request's cumulative output, rebuilt from its deltas."""

    sink: Sink
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    completions: dict[int, CompletionOutput] | None = None

    def merge(self, delta: RequestOutput, starts: list[int]) -> RequestOutput:
        """Apply one delta; returns the cumulative output (fresh lists: sinks may keep it)."""
        if self.completions is None:
            self.completions = {}
        for c, start in zip(delta.outputs, starts, strict=True):
            prev = self.completions.get(c.index)
            if prev is None:
                prev = self.completions[c.index] = CompletionOutput(c.index, "", [])
            prev.text = prev.text[:start] + c.text
            prev.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                if prev.logprobs is None:
                    prev.logprobs = []
                prev.logprobs.extend(c.logprobs)
            prev.finish_reason = c.finish_reason
            prev.stop_reason = c.stop_reason
            prev.cumulative_logprob = c.cumulative_logprob
        outs = [
            CompletionOutput(
                c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason,
                list(c.logprobs) if c.logprobs is not None else None, c.cumulative_logprob,
            )
            for c in sorted(self.completions.values(), key=lambda c: c.index)
        ]
        return RequestOutput(
            delta.request_id, self.prompt, list(self.prompt_token_ids), outs, delta.finished,
            delta.num_cached_tokens, delta.error,
        )
