"""The one output contract: per-step deltas out of the engine, one accumulator for totals.

``EngineCore.step()`` returns a ``RequestDelta`` per request that progressed, holding only what
each completion gained that step, so the controller's output cost per step is O(new tokens)
whatever the length so far. ``OutputAccumulator`` folds a request's deltas into the cumulative
``RequestOutput`` (``LLM.generate``'s return value, a non-streaming HTTP answer); streaming
front ends forward the deltas as they come.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pagedserve.controller.request import Request
from pagedserve.messages import (
    AddRequest,
    CompletionDelta,
    CompletionOutput,
    RequestDelta,
    RequestOutput,
)

__all__ = [
    "OutputAccumulator",
    "OutputCollector",
    "RequestGroup",
    "failed_delta",
    "final_output_sink",
    "take_delta",
]


def take_delta(seq: Request) -> CompletionDelta | None:
    """What ``seq`` gained since its last delta (None when nothing), and mark it sent.

    While stop strings may still match, the last ``len(longest stop) - 1`` characters stay
    back: a completing stop string truncates the text, and a sent character cannot be unsent.
    """
    finished = seq.is_finished
    tokens = seq.output_token_ids[seq.num_emitted_tokens :]
    detok = seq.detokenizer
    end = detok.text_len if detok is not None else 0
    if not finished and seq.stop_strings is not None:
        end -= seq.stop_strings.longest - 1
    start = seq.num_emitted_chars
    new_text = detok.text_from(start)[: end - start] if detok is not None and end > start else ""
    if not tokens and not new_text and not (finished and not seq.emitted_final):
        return None
    logprobs = None
    if seq.logprobs is not None:
        logprobs = seq.logprobs[seq.num_emitted_logprobs :]
        seq.num_emitted_logprobs = len(seq.logprobs)
    seq.num_emitted_tokens = seq.num_output_tokens
    seq.num_emitted_chars = max(seq.num_emitted_chars, end)
    seq.emitted_final = finished
    return CompletionDelta(
        seq.index, tokens, new_text, logprobs, seq.finish_reason, seq.stop_reason,
        seq.cumulative_logprob,
    )


@dataclasses.dataclass(slots=True)
class RequestGroup:
    """One user request in the engine: its ``n`` completion sequences (and the fork parent,
    until it forks); ``delta()`` is its output of a step."""

    request_id: str
    seqs: list[Request]
    parent: Request | None
    final_only: bool = False
    """``delta()`` only once finished (``AddRequest.final_only``)."""
    num_emitted_prompt_logprobs: int = 0

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def num_cached_tokens(self) -> int:
        cached = self.parent.num_cached_tokens if self.parent is not None else -1
        return max(0, cached, *(s.num_cached_tokens for s in self.seqs))

    def seq_ids(self) -> list[str]:
        """Every scheduler id of the request: the fork parent (if unforked) and its seqs."""
        parent = [self.parent.request_id] if self.parent is not None else []
        return parent + [s.request_id for s in self.seqs]

    def delta(self) -> RequestDelta | None:
        if self.final_only and not self.finished:
            return None
        comps = [d for s in self.seqs if (d := take_delta(s)) is not None]
        # Every sequence of the group (and its fork parent) shares one prompt-logprobs list.
        lps = self.seqs[0].prompt_logprobs
        new_lps = None
        if lps is not None and len(lps) > self.num_emitted_prompt_logprobs:
            new_lps = lps[self.num_emitted_prompt_logprobs :]
            self.num_emitted_prompt_logprobs = len(lps)
        if not comps and new_lps is None:
            return None
        return RequestDelta(
            self.request_id, comps, self.finished, self.num_cached_tokens,
            prompt_logprobs=new_lps,
            num_host_cached_tokens=max(0, *(s.num_host_cached_tokens for s in self.seqs),
                                       self.parent.num_host_cached_tokens if self.parent else 0),
        )


def failed_delta(
    request_id: str, indices: list[int], error: str, code: str | None = None
) -> RequestDelta:
    """The final delta of a request the engine could not finish (``code``: see
    ``RequestOutput.error_code``)."""
    comps = [CompletionDelta(i, [], "", finish_reason="error") for i in indices]
    return RequestDelta(request_id, comps, finished=True, error=error, error_code=code)


class OutputAccumulator:
    """One request's cumulative ``RequestOutput``, grown in place from its deltas."""

    def __init__(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], n: int
    ) -> None:
        self.output = RequestOutput(
            request_id, prompt, prompt_token_ids, [CompletionOutput(i, "", []) for i in range(n)]
        )

    def add(self, delta: RequestDelta) -> RequestOutput:
        """Fold one delta in; returns the (same, updated) cumulative output."""
        out = self.output
        for d in delta.completions:
            while d.index >= len(out.outputs):  # a collector that did not know n
                out.outputs.append(CompletionOutput(len(out.outputs), "", []))
            c = out.outputs[d.index]
            if c.finish_reason is not None:
                continue  # already final (an error delta names every completion)
            c.token_ids.extend(d.token_ids)
            c.text += d.text
            if d.logprobs is not None:
                if c.logprobs is None:
                    c.logprobs = []
                c.logprobs.extend(d.logprobs)
            c.finish_reason = d.finish_reason
            c.stop_reason = d.stop_reason
            c.cumulative_logprob = d.cumulative_logprob
        if delta.prompt_logprobs is not None:
            if out.prompt_logprobs is None:
                out.prompt_logprobs = []
            out.prompt_logprobs.extend(delta.prompt_logprobs)
        if delta.error is not None:
            for c in out.outputs:
                c.finish_reason = c.finish_reason or "error"
        out.finished = delta.finished
        out.num_cached_tokens = delta.num_cached_tokens
        out.num_host_cached_tokens = delta.num_host_cached_tokens
        out.error = delta.error
        out.error_code = delta.error_code
        return out


def final_output_sink(
    request: AddRequest, done: Callable[[RequestOutput], None]
) -> Callable[[RequestDelta], None]:
    """A sink that accumulates ``request``'s deltas and calls ``done`` with the final output
    (one delta, where ``request.final_only``)."""
    acc = OutputAccumulator(
        request.request_id, request.prompt, list(request.prompt_token_ids), request.params.n
    )

    def sink(delta: RequestDelta) -> None:
        out = acc.add(delta)
        if out.finished:
            done(out)

    return sink


class OutputCollector:
    """Cumulative outputs of many requests from a stream of deltas, for code that drives an
    ``EngineCore`` step by step (benchmarks, tests). ``expect`` records a request's prompt."""

    def __init__(self) -> None:
        self._accs: dict[str, OutputAccumulator] = {}

    def expect(self, request: AddRequest) -> None:
        self._accs[request.request_id] = OutputAccumulator(
            request.request_id, request.prompt, list(request.prompt_token_ids), request.params.n
        )

    def feed(self, deltas: list[RequestDelta]) -> list[RequestOutput]:
        """Fold the deltas in; returns the cumulative output of each request they touched."""
        outs = []
        for delta in deltas:
            acc = self._accs.get(delta.request_id)
            if acc is None:
                acc = self._accs[delta.request_id] = OutputAccumulator(
                    delta.request_id, None, [], 0
                )
            outs.append(acc.add(delta))
            if delta.finished:
                del self._accs[delta.request_id]
        return outs
