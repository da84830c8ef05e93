"""Speculative decoding with a draft model: a smaller checkpoint, on the same workers, guesses
each request's next tokens right after the step that verified its previous guesses.

KV: each draft attention layer writes a KV tensor of its own (``KVPool``), indexed by the
block table of one target group (``KVCacheLayout.draft_groups``). The target's block ids and
slots are the draft's, so whatever the KV manager does to a request's blocks (allocation,
prefix hits, trims of rejected drafts' blocks, copy-on-write, tier copies) it does to both.
That holds because the draft computes every position the target computes, in the same step.

After the target sampled, each step runs:

1. one pass over every scheduled row's positions, keeping the draft's KV in step with the
   target's. A row that sampled stops at its last accepted token instead of at its last draft
   (rejected drafts are not written) and takes that token as its last input, so the pass's
   last position of the row yields its first guess;
2. ``k - 1`` passes of one token per drafting row, each feeding the previous guess and writing
   its KV into the lookahead slots the scheduler reserved (``SchedulerOutput.
   num_lookahead_tokens``; a row drafts only as far as its blocks reach).

The guesses are greedy, so a draft is a point mass and the target's verification (keep samples
up to the first that differs from the draft) is exact rejection sampling for every sampling
mode. Under tensor parallelism the draft is sharded like the target; every rank holds the same
sampled tokens and gathered logits, so all take the same passes and reach the same guesses.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedserve.kernels import NO_CP, CPLayout
from pagedserve.kernels.argmax import argmax
from pagedserve.workers.block_table import MultiGroupBlockTable
from pagedserve.workers.context import forward_rows
from pagedserve.workers.input_batch import InputBatch

__all__ = ["DraftModel"]


class DraftModel:
    """The draft model of one rank and its passes; ``num_speculative_tokens`` is the most
    tokens a warm-up step asks for."""

    def __init__(
        self,
        model: nn.Module,
        tables: MultiGroupBlockTable,
        group: int,
        num_speculative_tokens: int,
        device: torch.device,
        cp: CPLayout = NO_CP,
    ) -> None:
        self.model = model
        self.tables = tables
        self.table = tables[group]  # its rows' lengths bound how far a row can draft
        self.num_speculative_tokens = num_speculative_tokens
        self.device = device
        self.cp = cp

    def step(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        start: np.ndarray,
        counts: np.ndarray,
        sample_mask: np.ndarray,
        accepted: list[list[int]],
        block_tables: list[torch.Tensor],
        k: int,
    ) -> dict[str, list[int]]:
        """Run the draft over this step's rows and guess up to ``k`` tokens per row that
        sampled. ``rows``, ``start``, ``counts``, ``sample_mask``: [R] as the target's step
        had them (``start`` its first position per row); ``accepted``: the tokens each sampling
        row accepted, in row order; ``block_tables``: per group the target's device table of
        those rows [R, width]. Returns the guesses per request id (rows that draft)."""
        num_acc = np.zeros(len(rows), dtype=np.int64)
        num_acc[sample_mask] = [len(a) for a in accepted]
        new_len = batch.num_tokens[rows] + num_acc  # [R] tokens once this step's are appended
        # A row drafts within max_model_len, its max_tokens and the slots its blocks hold:
        # guess j (1-based) is the token at position new_len - 1 + j, made by the pass that
        # writes the KV of position new_len - 2 + j.
        room = np.minimum(batch.max_model_len - new_len,
                          self.table.token_capacity(rows) - new_len + 1)
        room = np.minimum(room, k)
        for i in np.flatnonzero(sample_mask):
            p = batch.params[rows[i]]
            if p is not None and p.max_tokens is not None:
                produced = new_len[i] - batch.num_prompt_tokens[rows[i]]
                room[i] = min(room[i], p.max_tokens - produced - 1)
        drafting = sample_mask & (room > 0)  # [R]
        # Pass 1: a drafting row ends at its last accepted token (position new_len - 1), any
        # other sampling row before it, a prefill chunk where the target's chunk ended.
        end = np.where(sample_mask, new_len - 1 + drafting, start + counts)  # [R] exclusive
        n1 = end - start  # [R] >= 1: a sampling row computed position num_tokens - 1 at least
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(n1, out=cu[1:])
        req_idx = np.repeat(rows, n1)  # [T1]
        positions = np.repeat(start - cu[:-1], n1) + np.arange(cu[-1])  # [T1]
        ids = batch.token_ids[req_idx, positions].astype(np.int64)  # accepted drafts included
        last = cu[1:][drafting] - 1  # [D] the drafting rows' last position in the pass
        ids[last] = [a[-1] for a, d in zip(accepted, drafting[sample_mask], strict=True) if d]
        hidden = self._forward(req_idx, positions, ids, end, n1, block_tables, None)
        if not drafting.any():
            return {}
        guess = self._greedy(hidden, last)  # [D] device
        # Passes 2..k: one token per row still drafting, at the position after the last.
        d_rows = np.flatnonzero(drafting)  # [D] indices into rows
        d_room = room[d_rows]
        guesses = [guess]
        active = np.arange(len(d_rows))  # [A] indices into d_rows
        for j in range(2, int(d_room.max()) + 1):
            keep = d_room[active] >= j  # the active rows shrink as their room runs out
            if not keep.all():
                guess = guess[torch.from_numpy(np.flatnonzero(keep)).to(self.device)]
                active = active[keep]
            sel = d_rows[active]  # [A] indices into rows
            pos = new_len[sel] - 2 + j  # [A]
            ones = np.ones(len(sel), dtype=np.int64)
            hidden = self._forward(rows[sel], pos, guess, pos + 1, ones, block_tables, sel)
            guess = self._greedy(hidden, None)
            guesses.append(guess)
        flat = torch.cat(guesses).tolist()  # one read-back for every pass
        out: dict[str, list[int]] = {}
        at = 0
        for j, g in enumerate(guesses):
            n = g.shape[0]
            # Pass j + 1 guessed for the drafting rows with room > j, in order.
            for i, token in zip(np.flatnonzero(d_room > j), flat[at : at + n], strict=True):
                rid = batch.req_ids[rows[d_rows[i]]]
                assert rid is not None
                out.setdefault(rid, []).append(token)
            at += n
        return out

    def _forward(
        self,
        req_idx: np.ndarray,
        positions: np.ndarray,
        ids: np.ndarray | torch.Tensor,
        seq_lens: np.ndarray,
        counts: np.ndarray,
        block_tables: list[torch.Tensor],
        sel: np.ndarray | None,
    ) -> torch.Tensor:
        return forward_rows(self.model, self.tables.tables, block_tables, req_idx, positions,
                            ids, seq_lens, counts, sel, self.cp)

    def _greedy(self, hidden: torch.Tensor, at: np.ndarray | None) -> torch.Tensor:
        """Argmax of the draft's logits at rows ``at`` of ``hidden`` (None: every row) -> [N]."""
        if at is not None:
            hidden = hidden.index_select(0, torch.from_numpy(at).to(self.device))
        return argmax(self.model.compute_logits(hidden))  # type: ignore[operator]

