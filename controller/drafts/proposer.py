"""What a draft proposer is: given a request's tokens so far, guess the next few.

Proposers run on the controller between steps, on token ids only (no torch): prompt lookup
(``drafts.ngram``) and suffix trees (``drafts.suffix``); a draft model's proposer
(``drafts.model``) hands on what the workers' draft model guessed. The workers verify whatever
they propose, so a proposer can only cost speed, never change the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["Proposer"]


class Proposer(Protocol):
    def propose(
        self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, max_drafts: int
    ) -> list[int]:
        """Up to ``max_drafts`` (>= 1) tokens guessed to follow ``token_ids`` (the request's
        prompt then its outputs so far; it only ever grows between calls for one request id,
        except after ``release``). May return fewer, or none."""
        ...

    def release(self, request_id: str) -> None:
        """The request ended (finished, aborted or failed): forget its per-request state.
        Unknown ids are ignored."""
        ...
