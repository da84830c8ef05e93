"""The step-level side of speculative decoding: which requests get drafts before a step, and
what the verification made of them after it.

Before each schedule the drafter asks its proposer for drafts for every running request that
is decoding (its next step computes just its last token); the scheduler counts them in the
token budget and the workers verify them. It stands back while ``disable_by_batch_size`` or
more requests run: a full batch already keeps the machine busy. After the step it counts what
was proposed and accepted, per position, in vLLM's terms.

A draft model's drafts come from the workers (``drafts.model``): the drafter hands the step's
output to that proposer, and tells the scheduler to reserve lookahead slots, where the workers
write the draft model's KV while they draft, only in steps that speculate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pagedserve.config import SpeculativeConfig
from pagedserve.controller.drafts.model import ModelDrafts
from pagedserve.controller.drafts.ngram import NgramProposer
from pagedserve.controller.drafts.proposer import Proposer
from pagedserve.controller.drafts.suffix import SuffixProposer
from pagedserve.controller.request import Request
from pagedserve.messages import ModelRunnerOutput, SchedulerOutput

__all__ = ["Drafter", "make_proposer"]


def make_proposer(spec: SpeculativeConfig) -> Proposer:
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "suffix":
        return SuffixProposer(
            max_tree_depth=spec.suffix_decoding_max_tree_depth,
            max_cached_requests=spec.suffix_decoding_max_cached_requests,
            max_spec_factor=spec.suffix_decoding_max_spec_factor,
            min_token_prob=spec.suffix_decoding_min_token_prob,
        )
    if spec.method == "draft_model":
        return ModelDrafts()
    raise ValueError(f"no proposer for speculative method {spec.method!r}")


class Drafter:
    """Drafts for one engine's running requests, and the acceptance counters."""

    def __init__(
        self, proposer: Proposer, num_speculative_tokens: int, disable_by_batch_size: int | None,
        max_model_len: int,
    ) -> None:
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.max_model_len = max_model_len
        self.lookahead = num_speculative_tokens if isinstance(proposer, ModelDrafts) else 0
        """Slots past each request's tokens for the workers' draft model to write its KV in
        while it drafts (0: drafts come from the controller)."""
        self._live: set[str] = set()
        self.num_drafts = 0
        """Request-steps that verified at least one draft."""
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens
        """Drafts accepted at position ``i`` of their run (0 = the first draft)."""

    def propose(self, running: Sequence[Request]) -> int:
        """Set ``draft_token_ids`` on the running requests for the next step. Returns the
        lookahead slots the scheduler reserves this step: 0 while speculation stands back, so
        that the workers' draft model drafts nothing then."""
        off = self.disable_by_batch_size is not None and len(running) >= self.disable_by_batch_size
        for req in running:
            req.draft_token_ids = [] if off else self._drafts(req)
        return 0 if off else self.lookahead

    def _drafts(self, req: Request) -> list[int]:
        # Decoding only: a prefill chunk (or a fork parent) samples nothing to verify against.
        if req.children or req.num_computed_tokens != req.num_tokens - 1:
            return []
        n = req.num_tokens
        # d drafts write slots up to position n + d - 1 and yield up to d + 1 tokens: neither
        # may pass max_model_len or the request's max_tokens.
        room = min(self.k, self.max_model_len - n)
        if (max_tokens := req.sampling_params.max_tokens) is not None:
            room = min(room, max_tokens - req.num_output_tokens - 1)
        if room <= 0:
            return []
        self._live.add(req.request_id)
        return self.proposer.propose(
            req.request_id, req.all_token_ids, req.num_prompt_tokens, room
        )[:room]

    def record(
        self, so: SchedulerOutput, out: ModelRunnerOutput, requests: Mapping[str, Request]
    ) -> None:
        """Count the step's drafts and how many of each request's were accepted (its tokens
        but the last, which the model sampled itself). ``requests``: the live requests, with
        this step's tokens appended, for the drafts the workers' draft model made."""
        if out.draft_token_ids and isinstance(self.proposer, ModelDrafts):
            for rid, drafts in out.draft_token_ids.items():
                req = requests.get(rid)
                if req is not None and not req.is_finished:
                    self.proposer.receive(rid, req.num_tokens, drafts)
                    self._live.add(rid)
        if not so.draft_token_ids:
            return
        tokens = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
        for rid, drafts in so.draft_token_ids.items():
            got = tokens.get(rid)
            if got is None:
                continue
            accepted = min(len(got) - 1, len(drafts))
            self.num_drafts += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += accepted
            for i in range(accepted):
                self.accepted_per_pos[i] += 1

    def release_finished(self, requests: dict[str, Request]) -> None:
        """Forget the proposer state of requests no longer live (finished, aborted, failed)."""
        gone = [rid for rid in self._live
                if (r := requests.get(rid)) is None or r.status.finished]
        for rid in gone:
            self._live.discard(rid)
            self.proposer.release(rid)

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }
        for i, n in enumerate(self.accepted_per_pos):
            out[f"spec_decode_num_accepted_tokens_pos_{i}"] = n
        return out

