"""The controller's view of one sequence: its tokens, progress, block hashes and stop state.

A user request with ``n == 1`` is one ``Request``. With ``n > 1`` the engine first runs a *fork
parent* over the prompt minus its last token, then forks it into ``n`` child requests that share
its KV blocks (see ``scheduler.py``); each child is an ordinary ``Request`` from then on.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from pagedserve.controller.stop_strings import StopStrings
from pagedserve.controller.tokenizer import IncrementalDetokenizer
from pagedserve.kv.hashing import BlockHasher
from pagedserve.messages import SamplingParams

if TYPE_CHECKING:
    from pagedserve.controller.grammar_matcher import SequenceGrammar

__all__ = ["Request", "RequestStatus", "child_seed", "request_group", "sequence_ids"]

_SEED_STRIDE = 1_000_003  # a prime, so children of nearby seeds do not collide


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything above FINISHED_STOPPED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence, satisfying kv's request protocol (``request_id``, ``all_token_ids``,
    ``num_tokens``, ``num_computed_tokens``, ``block_hashes``, ``cache_salt``).

    ``block_hashes`` grows through kv's ``BlockHasher`` whenever tokens are appended, so every
    full block (generated tokens included) is hashed exactly once.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        hasher: BlockHasher | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        detokenizer: IncrementalDetokenizer | None = None,
        group_id: str | None = None,
        index: int = 0,
        children: Sequence[Request] = (),
        stop_strings: StopStrings | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.stop_strings = stop_strings
        """The stop strings' matcher, shared by a request's sequences (built here if none)."""
        if stop_strings is None and sampling_params.stop:
            self.stop_strings = StopStrings(sampling_params.stop)
        self.worker_params = (
            dataclasses.replace(sampling_params, stop=(), structured_outputs=None)
            if sampling_params.stop or sampling_params.structured_outputs else sampling_params
        )
        """What the workers get: stop strings and grammars are matched here, so they never
        travel (a grammar reaches the workers as each step's token masks)."""
        self.grammar: SequenceGrammar | None = None
        """The structured-output matcher of a sampling sequence under a constraint, attached
        once its grammar is compiled (``controller.structured_output``)."""
        self.cache_salt = cache_salt
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        """Prefix-cache hit at first admission; -1 until then."""
        self.num_host_cached_tokens = 0
        """Of that hit, the tokens found in the host tier."""
        self.num_preemptions = 0
        self.num_failures = 0
        """Worker-group failures this sequence was running through (``controller.recovery``)."""
        self.stop_reason: int | str | None = None
        self.detokenizer = detokenizer
        self.group_id = request_id if group_id is None else group_id
        """The user-facing request id this sequence belongs to."""
        self.index = index
        """Completion index within the user request (0 for n == 1)."""
        self.children: list[Request] = list(children)
        """Non-empty for a fork parent: the sequences it forks into once the prompt minus its
        last token is computed. The parent itself never samples."""
        self.logprobs: list[dict[int, float]] | None = (
            [] if sampling_params.logprobs is not None else None
        )
        self.cumulative_logprob: float | None = 0.0 if self.logprobs is not None else None
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None
        )
        """Per prompt position (None at 0), as far as computed. A fork parent shares this list
        with its children: the prompt's logprobs belong to the user request, once."""
        for child in self.children:
            child.prompt_logprobs = self.prompt_logprobs
        self.draft_token_ids: list[int] = []
        """Speculative tokens after ``all_token_ids`` for the next step to verify (set by a
        drafter between steps; none exists yet). Never hashed: they are not the sequence's."""
        self.num_sent_tokens = 0
        """How many of ``all_token_ids`` the workers hold, placeholders included; 0 while they
        do not know the request (never scheduled, or dropped on preemption)."""
        self.num_pending_samples = 0
        """Samples of steps scheduled and not yet answered. With async scheduling a step may be
        scheduled while the previous one runs: each pending sample then stands in the batch as
        a placeholder token that the workers fill with what they sampled."""
        # How much of the output the engine has handed out as deltas (see outputs.take_delta).
        self.num_emitted_tokens = 0
        self.num_emitted_chars = 0
        self.num_emitted_logprobs = 0
        self.emitted_final = False
        self.block_hashes: list[bytes] = []
        self._hasher = hasher
        self._update_block_hashes()

    # --------------------------------------------------------------- sizes
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def compute_limit(self) -> int:
        """The token count the scheduler catches ``num_computed_tokens`` up to: the known
        tokens (a fork parent's but the last), the pending samples' placeholders and the drafts
        after them."""
        if self.children:
            return self.num_tokens - 1
        return self.num_tokens + self.num_pending_samples + len(self.draft_token_ids)

    def pending_sample_is_last(self, max_model_len: int) -> bool:
        """A pending sample will end the request by length (``max_tokens`` or
        ``max_model_len``): computing its placeholder's KV would be wasted."""
        pending, cap = self.num_pending_samples, self.sampling_params.max_tokens
        return pending > 0 and (
            (cap is not None and self.num_output_tokens + pending >= cap)
            or self.num_tokens + pending >= max_model_len
        )

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are not computed yet: the prompt must be
        computed from its start, not taken from the prefix cache."""
        lps = self.prompt_logprobs
        return lps is not None and len(lps) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def output_text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer is not None else ""

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

    # ------------------------------------------------------------ mutation
    def advance(self, num_scheduled: int) -> None:
        """The scheduler gave a step ``num_scheduled`` of the request's tokens. A chunk that
        reaches the request's end is sampled (a fork parent stops one short and never is)."""
        self.num_computed_tokens += num_scheduled
        if not self.children and self.num_computed_tokens >= (
            self.num_tokens + self.num_pending_samples
        ):
            self.num_pending_samples += 1

    def _update_block_hashes(self) -> None:
        if self._hasher is not None:
            self._hasher.extend(self.block_hashes, self.all_token_ids, self.cache_salt)

    def append_output_token_id(
        self, token_id: int, eos_token_ids: Collection[int], max_model_len: int
    ) -> None:
        """Append one sampled token, detokenize it and apply the stop conditions."""
        # The workers sampled under this grammar's mask, so a refusal is a token that never
        # passed it (a banned stop token left no allowed one): the output ends before it.
        if self.grammar is not None and not self.grammar.accept(token_id):
            self.stop_reason = None
            self.finish(RequestStatus.FINISHED_STOPPED)
            return
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_block_hashes()
        params = self.sampling_params
        # min_tokens counts tokens *before* a stop, so a stop may be token min_tokens + 1.
        may_stop = self.num_output_tokens > params.min_tokens
        stopped_on_token = False
        if may_stop and not params.ignore_eos and token_id in eos_token_ids:
            stopped_on_token = True
            self.stop_reason = None
        elif may_stop and token_id in params.stop_token_ids:
            stopped_on_token = True
            self.stop_reason = token_id
        detok = self.detokenizer
        if stopped_on_token:
            # The stop token's text is left out unless asked for (an EOS's stays out while
            # special tokens are skipped); finish() still flushes bytes held back before it.
            if detok is not None and params.include_stop_str_in_output:
                detok.step([token_id])
            self.finish(self._stop_status())
            return
        if detok is not None:
            old_len = detok.text_len
            delta = detok.step([token_id])
            if delta and self.stop_strings and may_stop and self._check_stop_strings(old_len):
                return
        if self.grammar is not None and self.grammar.stopped and not self.is_finished:
            self.finish(self._stop_status())  # the constraint is complete
        elif self.tokens_left(max_model_len) <= 0:
            self.finish(RequestStatus.FINISHED_LENGTH_CAPPED)

    def tokens_left(self, max_model_len: int) -> int:
        """How many more tokens the sequence may take before ``max_tokens`` or the model's
        length caps it."""
        left = max_model_len - self.num_tokens
        if (max_tokens := self.sampling_params.max_tokens) is not None:
            left = min(left, max_tokens - self.num_output_tokens)
        return left

    def _stop_status(self) -> RequestStatus:
        """A stop, or a length cap where the budget forced the grammar's completion: the
        model did not end its answer, the tokens left did."""
        if self.grammar is not None and self.grammar.closed_by_budget:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return RequestStatus.FINISHED_STOPPED

    def append_output_token_ids(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[tuple[Sequence[int], Sequence[float]]] | None,
        eos_token_ids: Collection[int],
        max_model_len: int,
    ) -> None:
        """Append one step's accepted tokens (with their logprobs, if asked for) in order,
        checking the stop conditions after each: the tokens after the one that finishes the
        request are dropped, as if never sampled."""
        for i, token_id in enumerate(token_ids):
            self.append_output_token_id(token_id, eos_token_ids, max_model_len)
            if logprobs is not None:
                self.record_logprobs(*logprobs[i])
            if self.is_finished:
                return

    def record_logprobs(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """Keep the worker's ``[sampled, top_1, ...]`` log-probabilities, if they were asked for."""
        if self.logprobs is None or not token_ids:
            return
        self.logprobs.append(dict(zip(token_ids, logprobs, strict=True)))
        assert self.cumulative_logprob is not None
        self.cumulative_logprob += logprobs[0]

    def record_prompt_logprobs(
        self, first: int, token_ids: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]]
    ) -> bool:
        """Keep the worker's prompt logprobs of positions ``first, first + 1, ...`` (rows of
        ``[prompt token, top_1, ...]``). Positions already known (computed again after a
        preemption, or by another sequence of the same request) are skipped. True if any was
        new."""
        lps = self.prompt_logprobs
        if lps is None:
            return False
        before = len(lps)
        for pos, (ids, values) in enumerate(zip(token_ids, logprobs, strict=True), start=first):
            if pos == len(lps) and pos < self.num_prompt_tokens:
                lps.append(dict(zip(ids, values, strict=True)))
        return len(lps) > before

    def _check_stop_strings(self, old_len: int) -> bool:
        """Truncate at the first stop string that ends in the new text; True if one did."""
        detok, stops = self.detokenizer, self.stop_strings
        assert detok is not None and stops is not None
        # A match must end inside the new delta, so it starts at most longest-1 chars earlier.
        search_from = max(0, old_len - stops.longest + 1)
        hit = stops.find(detok.text_from(search_from), detok.text_len - old_len)
        if hit is None:
            return False
        kept = len(hit[1]) if self.sampling_params.include_stop_str_in_output else 0
        detok.truncate(search_from + hit[0] + kept)
        self.stop_reason = hit[1]
        self.status = RequestStatus.FINISHED_STOPPED
        return True

    def finish(self, status: RequestStatus) -> None:
        """Mark finished; release any text held back for an incomplete character."""
        assert status.finished
        if self.detokenizer is not None and status != RequestStatus.FINISHED_ABORTED:
            self.detokenizer.flush()
        self.status = status


def child_seed(seed: int | None, index: int) -> int | None:
    """Seed of completion ``index``: completion 0 keeps the user's seed, so ``n=1`` and ``n>1``
    agree on it; the others get a deterministic, distinct derivation."""
    if seed is None or index == 0:
        return seed
    return (seed + index * _SEED_STRIDE) % 2**63


def sequence_ids(request_id: str, n: int) -> list[str]:
    """Every scheduler id of a user request: itself, and its sequences ``id#i`` when ``n > 1``."""
    return [request_id] + ([f"{request_id}#{i}" for i in range(n)] if n > 1 else [])


def request_group(
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    detokenizer: Callable[[SamplingParams], IncrementalDetokenizer | None] | None = None,
    **request_args: Any,
) -> tuple[Request, list[Request]]:
    """``(head, sequences)``: what the scheduler queues for one user request and the sequences
    that produce its completions.

    With ``n == 1`` the head is the only sequence. With ``n > 1`` the head is a fork parent that
    computes the shared prompt once and never samples; its children ``id#i`` each produce
    completion ``i`` with its own seed (``child_seed``). ``detokenizer`` makes a sampling
    sequence's detokenizer; ``request_args`` (hasher, cache salt, arrival time, priority) go to
    every ``Request``.
    """
    ids = list(prompt_token_ids)
    stops = StopStrings(params.stop) if params.stop else None  # once for all n sequences

    def make(seq_id: str, index: int, p: SamplingParams, children: list[Request]) -> Request:
        detok = detokenizer(p) if detokenizer is not None and not children else None
        return Request(seq_id, ids, p, detokenizer=detok, group_id=request_id, index=index,
                       children=children, stop_strings=stops, **request_args)

    if params.n == 1:
        head = make(request_id, 0, params, [])
        return head, [head]
    seqs = [
        make(sid, i, dataclasses.replace(params, n=1, seed=child_seed(params.seed, i)), [])
        for i, sid in enumerate(sequence_ids(request_id, params.n)[1:])
    ]
    return make(request_id, 0, dataclasses.replace(params, n=1), seqs), seqs
