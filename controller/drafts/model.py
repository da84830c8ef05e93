"""Drafts of a draft model: the workers make them, the controller only hands them on.

With ``method="draft_model"`` a smaller model runs on the workers, after the target in the same
step: for every request that sampled, it guesses the tokens that follow the ones just accepted
(``ModelRunnerOutput.draft_token_ids``). This proposer keeps them until that request's next
step and proposes them then, provided the request's tokens are still the ones they follow (a
request whose step was cut short, or whose tokens were not appended, gets none).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ModelDrafts"]


class ModelDrafts:
    """``Proposer`` for ``method="draft_model"``, fed by ``receive`` after each step."""

    def __init__(self) -> None:
        # request id -> (number of tokens the drafts follow, the drafts)
        self._drafts: dict[str, tuple[int, list[int]]] = {}

    def receive(self, request_id: str, num_tokens: int, drafts: list[int]) -> None:
        """The workers' drafts for the request once it holds ``num_tokens`` tokens."""
        self._drafts[request_id] = (num_tokens, drafts)

    def propose(
        self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, max_drafts: int
    ) -> list[int]:
        got = self._drafts.get(request_id)
        if got is None or got[0] != len(token_ids):
            return []
        return got[1][:max_drafts]

    def release(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)
