"""Persistent per-request rows on a worker, kept in step with the scheduler's deltas.

A request gets a row when it first arrives (``add_request``) and keeps it until it finishes
or is preempted (``remove_request``). ``condense`` then moves the last rows into the holes so
rows ``[0, num_reqs)`` are dense. Token ids live in a host numpy matrix; the sampling
parameters in per-row numpy columns so the sampler can gather them vectorised.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedserve.messages import PLACEHOLDER_TOKEN, NewRequestData, SamplingParams
from pagedserve.workers.block_table import MultiGroupBlockTable

# Per-row float/int columns copied from SamplingParams (name -> numpy dtype).
_PARAM_COLUMNS = {
    "temperature": np.float32,
    "top_p": np.float32,
    "top_k": np.int64,
    "min_p": np.float32,
    "repetition_penalty": np.float32,
    "presence_penalty": np.float32,
    "frequency_penalty": np.float32,
}


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        vocab_size: int,
        block_table: MultiGroupBlockTable,
        device: torch.device,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        self.block_table = block_table
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.index_of: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.last_sampled: dict[str, int] = {}
        """Each request's latest sample: what a ``PLACEHOLDER_TOKEN`` stands for."""
        self.columns = {k: np.zeros(max_num_reqs, dtype=t) for k, t in _PARAM_COLUMNS.items()}

    @property
    def num_reqs(self) -> int:
        return len(self.index_of)

    def _free_row(self) -> int:
        # Lowest free row: holes left by removals are refilled before condensing.
        for row, rid in enumerate(self.req_ids):
            if rid is None:
                return row
        raise RuntimeError(f"input batch is full ({self.max_num_reqs} requests)")

    def add_request(self, req: NewRequestData) -> int:
        """Give the request a row. Raises, before any change, for tokens outside the
        vocabulary or past ``max_model_len`` and for a seed past 64 bits; a parameter its
        column cannot hold raises midway (the caller removes the row again)."""
        tokens = list(req.prompt_token_ids) + list(req.output_token_ids)
        if len(tokens) > self.max_model_len:
            raise ValueError(f"request {req.req_id}: {len(tokens)} tokens > max_model_len")
        ids = np.asarray(tokens)
        # An id past int64 makes an object array; one past the vocabulary would index the
        # embedding out of bounds in the batch's forward (on CUDA a device-side assert).
        if ids.size and (
            ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= self.vocab_size
        ):
            raise ValueError(
                f"request {req.req_id}: a token id outside the vocabulary [0, {self.vocab_size})"
            )
        seed = req.sampling_params.seed
        if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2**64):
            # Its noise seeds (``sampler.noise_seed``) would wrap onto another seed's.
            raise ValueError(f"request {req.req_id}: seed {seed} is outside [0, 2**64)")
        if req.req_id in self.index_of:
            self.remove_request(req.req_id)
        row = self._free_row()
        self.req_ids[row] = req.req_id
        self.index_of[req.req_id] = row
        self.token_ids[row, : len(tokens)] = ids
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(req.prompt_token_ids)
        self.num_computed_tokens[row] = req.num_computed_tokens
        sp = req.sampling_params
        self.params[row] = sp
        for name, col in self.columns.items():
            col[row] = getattr(sp, name)
        self.block_table.add_row(req.block_ids, row)
        return row

    def append_tokens(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Placeholders (a step scheduled before the controller had the sample of the step
        before) take the request's latest sample."""
        if PLACEHOLDER_TOKEN in token_ids:
            last = self.last_sampled.get(req_id)
            if last is None:  # the controller and this worker disagree: fail the step, loudly
                raise ValueError(f"request {req_id}: a placeholder token, but this worker has "
                                 "sampled nothing for it")
            token_ids = [last if t == PLACEHOLDER_TOKEN else t for t in token_ids]
        row = self.index_of[req_id]
        n = self.num_tokens[row]
        if n + len(token_ids) > self.max_model_len:
            raise ValueError(f"request {req_id}: exceeds max_model_len {self.max_model_len}")
        self.token_ids[row, n : n + len(token_ids)] = token_ids
        self.num_tokens[row] = n + len(token_ids)

    def write_drafts(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Put a step's draft tokens after the row's known tokens, as inputs of this step only:
        ``num_tokens`` stays, so the next ``append_tokens`` writes the accepted ones over them."""
        row = self.index_of[req_id]
        n = self.num_tokens[row]
        if n + len(token_ids) > self.max_model_len:
            raise ValueError(f"request {req_id}: drafts exceed max_model_len {self.max_model_len}")
        self.token_ids[row, n : n + len(token_ids)] = token_ids

    def remove_request(self, req_id: str) -> int | None:
        row = self.index_of.pop(req_id, None)
        self.last_sampled.pop(req_id, None)
        if row is None:
            return None
        self.req_ids[row] = None
        self.params[row] = None
        self.num_tokens[row] = 0
        self.block_table.clear_row(row)
        return row

    def condense(self) -> None:
        """Move the highest rows into the holes until rows ``[0, num_reqs)`` are all used."""
        n = self.num_reqs
        holes = [r for r in range(n) if self.req_ids[r] is None]
        tail = [r for r in range(self.max_num_reqs - 1, n - 1, -1) if self.req_ids[r] is not None]
        for dst, src in zip(holes, tail, strict=True):
            self._move(src, dst)

    def _move(self, src: int, dst: int) -> None:
        rid = self.req_ids[src]
        assert rid is not None
        k = self.num_tokens[src]
        self.token_ids[dst, :k] = self.token_ids[src, :k]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens):
            arr[dst] = arr[src]
        for col in self.columns.values():
            col[dst] = col[src]
        for lst in (self.req_ids, self.params):
            lst[dst] = lst[src]
            lst[src] = None
        self.num_tokens[src] = 0
        self.index_of[rid] = dst
        self.block_table.move_row(src, dst)
        self.block_table.clear_row(src)
