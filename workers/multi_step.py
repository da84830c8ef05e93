"""Several decode passes in one step (``SchedulerOutput.num_decode_steps``).

After a decode step samples, each row feeds its sample back and samples again, up to the
step's count, so a small batch pays the controller's round trip (schedule, send, take in,
detokenize) once per several tokens instead of once per token.

A row stops at its room: the lookahead slots its blocks hold, ``max_tokens`` and
``max_model_len``; and at its first stop token (EOS unless ignored, ``stop_token_ids``) once
``min_tokens`` allows one. The controller applies every stop condition again and drops what
follows a stop (a stop string's too). Each pass samples as a step would (penalties, seeds,
``min_tokens`` and logprobs see every token before it), so the tokens are those one step per
token samples. The samples are written after the row's known tokens, like drafts, and its
token count stays: the controller's next step appends them.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from torch import nn

from pagedserve.kernels import CPLayout
from pagedserve.messages import ModelRunnerOutput
from pagedserve.workers.context import forward_rows
from pagedserve.workers.input_batch import InputBatch
from pagedserve.workers.sampler import Sampler, SamplingMetadata, stop_tokens

__all__ = ["decode_more"]


class ModelRunner(Protocol):
    """What the passes use of ``workers.model_runner.ModelRunner``."""

    model: nn.Module
    batch: InputBatch
    sampler: Sampler
    cp: CPLayout
    eos_token_ids: tuple[int, ...]

    def sampling_metadata(self, rows: np.ndarray, offsets: np.ndarray) -> SamplingMetadata: ...


def decode_more(
    runner: ModelRunner,
    out: ModelRunnerOutput,
    rows: np.ndarray,
    sample_mask: np.ndarray,
    block_tables: list[torch.Tensor],
    steps: int,
) -> None:
    """Extend ``out``'s one sample per row to up to ``steps``. ``rows``, ``sample_mask``: [R]
    the step's batch rows and which of them sampled (``out``'s rows, in order);
    ``block_tables``: per group the step's device table of ``rows`` [R, width]."""
    b = runner.batch
    idx = np.flatnonzero(sample_mask)  # [N] each sampling row's index into rows
    srows = rows[idx]  # [N] batch rows, in out's order
    n0 = b.num_tokens[srows].copy()  # [N] known tokens; the first sample is token n0
    total = _room(runner, srows, n0, steps)  # [N] >= 1 samples each row may take
    tokens = out.sampled_token_ids
    active = [i for i in range(len(srows)) if total[i] > 1 and not _stops(runner, srows[i],
                                                                          tokens[i][-1], n0[i])]
    try:
        while active:
            a = np.asarray(active)
            r = srows[a]  # [A]
            pos = b.num_tokens[r]  # [A] the fed sample's position
            feed = np.asarray([tokens[i][-1] for i in active], dtype=np.int64)
            b.token_ids[r, pos] = feed
            b.num_tokens[r] = pos + 1
            ones = np.ones(len(a), dtype=np.int64)
            hidden = forward_rows(runner.model, b.block_table.tables, block_tables, r, pos,
                                  feed, pos + 1, ones, idx[a], runner.cp)  # [A, hidden]
            logits = runner.model.compute_logits(hidden)  # [A, V]
            result = runner.sampler(logits, runner.sampling_metadata(r, np.zeros_like(pos)))
            sampled = result.sampled.tolist()  # [A]
            ids = lps = None
            if out.logprobs is not None and result.logprob_ids is not None:
                assert result.logprobs is not None
                ids, lps = result.logprob_ids.tolist(), result.logprobs.tolist()
            still = []
            for k, i in enumerate(active):
                tokens[i].append(sampled[k])
                if ids is not None and lps is not None and out.logprobs is not None:
                    row_lps = out.logprobs[i]
                    p = b.params[srows[i]]
                    if row_lps is not None and p is not None and p.logprobs is not None:
                        row_lps.append((ids[k][: 1 + p.logprobs], lps[k][: 1 + p.logprobs]))
                if len(tokens[i]) < total[i] and not _stops(runner, srows[i], sampled[k],
                                                             n0[i] + len(tokens[i]) - 1):
                    still.append(i)
            active = still
    finally:
        b.num_tokens[srows] = n0  # the samples stay written after them, as drafts do
    for i, r in enumerate(srows):
        b.num_computed_tokens[r] = n0[i] + len(tokens[i]) - 1
        b.last_sampled[out.req_ids[i]] = tokens[i][-1]


def _room(runner: ModelRunner, rows: np.ndarray, n0: np.ndarray, steps: int) -> np.ndarray:
    """[N] samples each row may take in all: sample ``j`` (1-based) is token ``n0 + j - 1``,
    and the pass that makes it writes the KV of the token before, at position ``n0 + j - 2``,
    into a lookahead slot."""
    b = runner.batch
    slots = np.min([t.token_capacity(rows) for t in b.block_table.tables], axis=0)
    room = np.minimum(np.minimum(b.max_model_len, slots + 1) - n0, steps)
    for i, r in enumerate(rows):
        p = b.params[r]
        if p is not None and p.max_tokens is not None:
            room[i] = min(room[i], p.max_tokens - (n0[i] - b.num_prompt_tokens[r]))
    return np.maximum(room, 1)


def _stops(runner: ModelRunner, row: int, token: int, index: int) -> bool:
    """Does sample ``token``, the row's token ``index``, end the request (as the controller's
    stop conditions would, stop strings aside)?"""
    b = runner.batch
    p = b.params[row]
    if p is None or index - b.num_prompt_tokens[row] + 1 <= p.min_tokens:
        return False
    return token in stop_tokens(p, runner.eos_token_ids)
