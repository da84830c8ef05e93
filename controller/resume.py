"""Moving a request to a new controller: what a front end keeps of each request in flight,
and how the new engine rebuilds the request from it.

A controller's death takes its queues, KV blocks and detokenizers with it, but the front end
has seen every delta it forwarded, and that is all a new controller needs: the prompt, the
sampling parameters and each completion's tokens so far (``ResumeState``, folded by
``ResumeTracker``). The new engine replays those tokens through each sequence's stop
conditions and detokenizer exactly as it would have appended them after sampling, so its
text, stop-string and ``max_tokens`` state are the old one's; it marks them as already sent,
so its deltas continue where the client's stream stopped; and it computes their KV again (its
prefix cache starts cold). A seeded request carries on with the same tokens: the workers' noise
is a function of the seed and the output position, nothing else.

With ``n > 1`` the completions stay children of one fork parent that computes the shared
prompt once; the finished ones are not run again.
"""

from __future__ import annotations

from pagedserve.controller.errors import InvalidTokenError, RequestError
from pagedserve.controller.outputs import RequestGroup
from pagedserve.controller.request import Request, RequestStatus
from pagedserve.controller.scheduler import Scheduler
from pagedserve.messages import RequestDelta, ResumeState

__all__ = ["ResumeTracker", "resume_group"]


class ResumeTracker:
    """What a client has forwarded of one request with ``n`` completions. ``add`` folds each
    delta in (in order, before handing it on); ``state()`` is what a new controller needs."""

    __slots__ = ("_state",)

    def __init__(self, n: int) -> None:
        self._state = ResumeState([[] for _ in range(n)], [0] * n, [None] * n, [False] * n)

    def add(self, delta: RequestDelta) -> None:
        s = self._state
        for c in delta.completions:
            if c.index >= len(s.finished) or s.finished[c.index]:
                continue  # a final error delta names every completion, finished ones too
            s.token_ids[c.index].extend(c.token_ids)
            s.num_chars[c.index] += len(c.text)
            if c.cumulative_logprob is not None:
                s.cumulative_logprobs[c.index] = c.cumulative_logprob
            s.finished[c.index] = c.finish_reason is not None
        if delta.prompt_logprobs is not None:
            s.num_prompt_logprobs += len(delta.prompt_logprobs)

    def unfinished(self) -> list[int]:
        """The completions whose final delta has not been received."""
        return [i for i, done in enumerate(self._state.finished) if not done]

    def state(self) -> ResumeState | None:
        """A copy of what was received; None when nothing was (the request starts afresh)."""
        s = self._state
        if not (s.num_prompt_logprobs or any(s.finished) or any(s.token_ids)):
            return None
        return ResumeState([list(t) for t in s.token_ids], list(s.num_chars),
                           list(s.cumulative_logprobs), list(s.finished), s.num_prompt_logprobs)


def resume_group(
    group: RequestGroup, head: Request, state: ResumeState, vocab_size: int, sched: Scheduler
) -> None:
    """Bring a request built afresh by ``request_group`` (``head``, and ``group`` over its
    sequences) to ``state``, under ``sched``'s stop conditions (EOS ids, ``max_model_len``).
    Raises a ``RequestError`` subclass for a state that cannot be this request's (wrong shape,
    tokens outside the vocabulary, or tokens after which it would already have finished); only
    these new objects have changed then."""
    seqs = group.seqs
    n = len(seqs)
    columns = (state.token_ids, state.num_chars, state.cumulative_logprobs, state.finished)
    if any(len(column) != n for column in columns):
        raise RequestError(f"the resume state does not describe the request's n={n} completions")
    if all(state.finished):
        raise RequestError("every completion of the resumed request is finished")
    for i, ids in enumerate(state.token_ids):
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < vocab_size]
        if bad:
            raise InvalidTokenError(f"resumed completion {i}: token {bad[0]!r} is outside the "
                                    f"vocabulary [0, {vocab_size})")
    for seq, ids, chars, cumulative, finished in zip(seqs, *columns, strict=True):
        if finished:
            seq.status = RequestStatus.FINISHED_STOPPED
            seq.emitted_final = True
            continue
        for token_id in ids:
            seq.append_output_token_id(token_id, sched.eos_token_ids, sched.max_model_len)
            if seq.is_finished:  # the old engine would have ended it here and said so
                raise RequestError(f"resumed completion {seq.index} would have finished "
                                   f"within its {len(ids)} tokens")
        text_len = seq.detokenizer.text_len if seq.detokenizer is not None else 0
        if not 0 <= chars <= text_len:
            raise RequestError(f"resumed completion {seq.index}: {chars} characters received, "
                               f"but its tokens make {text_len}")
        seq.num_emitted_tokens = len(ids)
        seq.num_emitted_chars = chars
        # Logprobs of the replayed tokens were sent: ``seq.logprobs`` holds the new ones only.
        if seq.cumulative_logprob is not None and cumulative is not None:
            seq.cumulative_logprob = cumulative
    if head.children:
        head.children = [s for s in head.children if not s.is_finished]
    _resume_prompt_logprobs(group, head, state.num_prompt_logprobs)


def _resume_prompt_logprobs(group: RequestGroup, head: Request, received: int) -> None:
    """The prompt positions received are placeholders, never computed or sent again; the
    sequences share one list, so the head's stands for all."""
    lps = head.prompt_logprobs
    if lps is None or not received:
        return
    if received > head.num_prompt_tokens:
        raise RequestError(f"{received} prompt logprobs received for a prompt of "
                           f"{head.num_prompt_tokens} tokens")
    lps.extend([None] * (received - len(lps)))
    group.num_emitted_prompt_logprobs = received
