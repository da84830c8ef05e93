"""One step on one rank: apply the scheduler's deltas, build inputs, run the model, sample.

The runner owns the persistent ``InputBatch`` and block tables. Each step it:
1. drops finished rows, appends new tokens / block ids to running rows, adds new requests,
   condenses the batch;
2. runs the host-tier copies (device -> host, then host -> device), then copy-on-write copies;
3. builds positions, ``cu_seqlens_q``, ``seq_lens`` and per-group slot mappings for the rows
   with scheduled tokens;
4. runs the model, projects only the sampled positions' hidden states to logits (each sampling
   row's last one, and with ``k`` drafts the ``k`` before it too), samples, and keeps a row's
   samples up to the first that differs from its draft at that position;
5. for requests that asked for prompt logprobs, projects the hidden states of the prompt
   positions computed this step too, and reports each next prompt token's log-probability;
6. with a draft model (``workers/draft_model.py``), runs it over the step's rows and returns
   its guesses of each sampling row's next tokens, the next step's drafts; with
   ``num_decode_steps`` (``workers/multi_step.py``), feeds each sample back for more.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedserve.kernels import NO_CP, CPLayout, copy_blocks
from pagedserve.messages import ModelRunnerOutput, SamplingParams, SchedulerOutput
from pagedserve.workers.context import AttentionMetadata, ForwardContext, forward_context, to_device
from pagedserve.workers.draft_model import DraftModel
from pagedserve.workers.input_batch import InputBatch
from pagedserve.workers.kv_pool import KVPool
from pagedserve.workers.multi_step import decode_more
from pagedserve.workers.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    noise_seed,
    stop_tokens,
    unpack_bitmask,
)

PROMPT_LOGITS_BYTES = 1 << 28
"""At most this many bytes of float32 logits at once when scoring a chunk's prompt tokens."""


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        batch: InputBatch,
        kv_pool: KVPool,
        sampler: Sampler,
        device: torch.device,
        cp: CPLayout = NO_CP,
        eos_token_ids: tuple[int, ...] = (),
        draft: DraftModel | None = None,
    ) -> None:
        self.eos_token_ids = eos_token_ids
        self.draft = draft
        self.model = model
        self.batch = batch
        self.kv_pool = kv_pool
        self.sampler = sampler
        self.device = device
        self.cp = cp

    # 1. state ---------------------------------------------------------------------------------

    def update_state(self, so: SchedulerOutput) -> dict[str, str]:
        """Apply the step's deltas. Returns the new requests that could not be added, with the
        error: each one's failure is its own (its row is removed again and it runs nothing),
        never the batch's."""
        batch = self.batch
        for rid in so.finished_req_ids:
            batch.remove_request(rid)
        for rid, num_blocks in so.block_table_trims.items():
            if (row := batch.index_of.get(rid)) is not None:
                batch.block_table.truncate_row(row, num_blocks)
        cached = so.cached_reqs
        for i, rid in enumerate(cached.req_ids):
            row = batch.index_of.get(rid)
            if row is None:
                raise KeyError(f"running request {rid!r} is not in this worker's batch")
            if cached.new_token_ids and cached.new_token_ids[i]:
                batch.append_tokens(rid, cached.new_token_ids[i])
            if cached.new_block_ids and cached.new_block_ids[i] is not None:
                batch.block_table.append_row(cached.new_block_ids[i], row)
            batch.num_computed_tokens[row] = cached.num_computed_tokens[i]
        errors: dict[str, str] = {}
        for req in so.new_reqs:
            try:
                batch.add_request(req)
            except Exception as exc:  # a value of this request's, not a fault of the rank
                batch.remove_request(req.req_id)
                errors[req.req_id] = f"{type(exc).__name__}: {exc}"
        batch.condense()
        for rid, drafts in so.draft_token_ids.items():
            if rid not in errors:
                batch.write_drafts(rid, drafts)
        return errors

    # 2-4. the step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        errors = self.update_state(so)
        self.kv_pool.copy_tiers(so.blocks_to_host, so.blocks_to_device)
        if so.block_copies:
            pairs = torch.tensor([list(p) for p in so.block_copies], dtype=torch.int64)
            copy_blocks(self.kv_pool.tensors, pairs.to(self.device))
        batch = self.batch
        rows = [
            r for r in range(batch.num_reqs) if so.num_scheduled_tokens.get(batch.req_ids[r], 0)
        ]
        out = ModelRunnerOutput(step_id=so.step_id, request_errors=errors)
        if not rows:
            return out
        rows_np = np.asarray(rows, dtype=np.int64)
        rids: list[str] = [batch.req_ids[r] for r in rows]  # type: ignore[misc]
        counts = np.asarray([so.num_scheduled_tokens[rid] for rid in rids])
        start = batch.num_computed_tokens[rows_np]
        seq_lens = start + counts
        # [R] drafts written after each row's known tokens: they end its chunk when it samples
        drafts = so.draft_token_ids
        num_drafts = np.zeros(len(rows), dtype=np.int64)
        if drafts:
            num_drafts[:] = [len(drafts.get(rid, ())) for rid in rids]
        known = batch.num_tokens[rows_np] + num_drafts
        if (seq_lens > known).any():
            raise ValueError("scheduled tokens past the end of a request's known tokens")
        sample_mask = seq_lens == known

        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        req_idx = np.repeat(rows_np, counts)  # [T] batch row of each token
        positions = np.repeat(start - cu[:-1], counts) + np.arange(cu[-1])  # [T]
        input_ids = batch.token_ids[req_idx, positions]

        to_dev = self._to_device
        rows_dev = to_dev(rows_np)
        cu_dev = to_dev(cu, torch.int32)
        seq_lens_dev = to_dev(seq_lens, torch.int32)
        groups = []
        for table in batch.block_table.tables:
            full = table.commit(batch.num_reqs)  # [num_reqs, width]
            groups.append(
                AttentionMetadata(
                    slot_mapping=to_dev(table.slot_mapping(req_idx, positions)),
                    block_table=full.index_select(0, rows_dev),
                    seq_lens=seq_lens_dev,
                    cu_seqlens_q=cu_dev,
                )
            )
        ctx = ForwardContext(groups, self.cp)
        with forward_context(ctx):
            hidden = self.model(to_dev(input_ids), to_dev(positions))  # [T, hidden]
        batch.num_computed_tokens[rows_np] = seq_lens
        out.prompt_logprobs = self._prompt_logprobs(rows_np, start, counts, cu, hidden)

        sample_rows = rows_np[sample_mask]
        tables = [md.block_table for md in groups]
        if len(sample_rows) == 0:
            if self.draft is not None:  # its KV follows the target's: the prefill chunks' too
                self.draft.step(batch, rows_np, start, counts, sample_mask, [], tables, 0)
            if self.device.type == "cuda":
                # Nothing is read back this step, so wait here: the next step rewrites the
                # pinned block-table buffers that this step's async copies read from.
                torch.cuda.current_stream(self.device).synchronize()
            return out
        # Each sampling row samples its last 1 + k positions (k drafts); n_per_row: [N].
        n_per_row = num_drafts[sample_mask] + 1
        flat = sample_positions(cu[1:][sample_mask] - 1, n_per_row)  # [M] into hidden
        logits = self.model.compute_logits(hidden.index_select(0, to_dev(flat)))  # [M, V]
        # Sample j of a row sees j more output tokens (its drafts) than the row holds.
        offsets = np.arange(len(flat)) - np.repeat(np.cumsum(n_per_row) - n_per_row, n_per_row)
        expanded = np.repeat(sample_rows, n_per_row)  # [M] batch row of each sample
        md = self.sampling_metadata(expanded, offsets)
        if so.token_masks:
            grammar = self._allowed(so.token_masks, sample_rows, n_per_row, logits.shape[1])
            md.allowed = grammar if md.allowed is None else md.allowed & grammar
        result = self.sampler(logits, md)
        out = self._output(out, sample_rows, n_per_row, drafts, result)
        if so.num_decode_steps > 1:
            decode_more(self, out, rows_np, sample_mask, tables, so.num_decode_steps)
        if self.draft is not None:
            out.draft_token_ids = self.draft.step(
                batch, rows_np, start, counts, sample_mask, out.sampled_token_ids, tables,
                so.num_lookahead_tokens,
            )
        return out

    def _allowed(self, masks: dict[str, bytes], sample_rows: np.ndarray, n_per_row: np.ndarray,
                 vocab_size: int) -> torch.Tensor:
        """[M, V] bool from the step's grammar masks: each constrained row's 1 + k rows of
        words in order; the other rows admit every token."""
        width = (vocab_size + 31) // 32
        words = np.full((int(n_per_row.sum()), width), -1, dtype=np.int32)
        at = 0
        for r, n in zip(sample_rows, n_per_row, strict=True):
            mask = masks.get(self.batch.req_ids[r])  # type: ignore[arg-type]
            if mask is not None:
                rows = np.frombuffer(mask, dtype="<i4").reshape(n, -1)
                words[at : at + n] = rows[:, :width]  # the grammar's rows may be a word wider
            at += n
        return unpack_bitmask(self._to_device(words, torch.int32), vocab_size)

    def _prompt_logprobs(
        self,
        rows: np.ndarray,
        start: np.ndarray,
        counts: np.ndarray,
        cu: np.ndarray,
        hidden: torch.Tensor,
    ) -> dict[str, tuple[int, list[list[int]], list[list[float]]]] | None:
        """Log-probabilities of the prompt tokens whose predecessors were computed this step.

        The logits of position ``q`` score prompt token ``q + 1``, so a chunk over positions
        ``[lo, hi)`` yields prompt positions ``lo + 1 ..`` up to the last prompt token; the logits
        of the last prompt position are the sampler's. Float32 log-softmax of the raw logits
        (no temperature or penalties), like the sampled tokens' logprobs. Every rank runs this
        (``compute_logits`` gathers over the tensor-parallel group); the output rank reports it.
        """
        b = self.batch
        picks: list[tuple[str, int, int, int, int]] = []  # (req id, row, lo, flat index, n)
        widths: list[int] = []  # 1 + top alternatives, per pick
        for i, r in enumerate(rows):
            p = b.params[r]
            num_prompt = int(b.num_prompt_tokens[r])
            # A row that already holds output tokens was resumed after its prompt was done.
            if p is None or p.prompt_logprobs is None or b.num_tokens[r] != num_prompt:
                continue
            lo = int(start[i])
            hi = min(lo + int(counts[i]), num_prompt - 1)
            rid = b.req_ids[r]
            if hi > lo and rid is not None:
                picks.append((rid, int(r), lo, int(cu[i]), hi - lo))
                widths.append(1 + p.prompt_logprobs)
        if not picks:
            return None
        flat = np.concatenate([np.arange(f, f + n) for *_, f, n in picks])
        targets = np.concatenate([b.token_ids[r, lo + 1 : lo + 1 + n] for _, r, lo, _, n in picks])
        flat_dev, targets_dev = self._to_device(flat), self._to_device(targets)
        k = max(widths) - 1
        # Bound the [rows, vocab] float32 logits of a long prompt chunk.
        step = max(1, PROMPT_LOGITS_BYTES // (4 * max(1, b.vocab_size)))
        ids_rows: list[list[int]] = []
        lp_rows: list[list[float]] = []
        for s in range(0, len(flat), step):
            logits = self.model.compute_logits(hidden.index_select(0, flat_dev[s : s + step]))
            lp = logits.log_softmax(-1)
            ids = targets_dev[s : s + step].unsqueeze(1)
            if k:
                ids = torch.cat([ids, lp.topk(k, dim=-1).indices], dim=1)
            ids_rows.extend(ids.tolist())
            lp_rows.extend(lp.gather(1, ids).tolist())
        result: dict[str, tuple[int, list[list[int]], list[list[float]]]] = {}
        at = 0
        for (rid, _, lo, _, n), width in zip(picks, widths, strict=True):
            result[rid] = (
                lo + 1,
                [row[:width] for row in ids_rows[at : at + n]],
                [row[:width] for row in lp_rows[at : at + n]],
            )
            at += n
        return result

    def _to_device(self, a: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return to_device(a, self.device, dtype)

    def sampling_metadata(self, rows: np.ndarray, offsets: np.ndarray) -> SamplingMetadata:
        """Per sample: its batch row and how many drafts precede its position in that row."""
        b = self.batch
        col = {k: torch.from_numpy(v[rows]).to(self.device) for k, v in b.columns.items()}
        params = [b.params[r] for r in rows]
        ends = b.num_tokens[rows] + offsets  # [M] tokens before each sampled one
        # A seeded sample's noise follows from its seed and the index of the output token it
        # produces, never from what the row sampled before (see ``noise_seed``).
        outputs = (ends - b.num_prompt_tokens[rows]).tolist()  # [M]
        md = SamplingMetadata(
            temperature=col["temperature"],
            top_k=col["top_k"],
            top_p=col["top_p"],
            min_p=col["min_p"],
            noise_seeds=[
                None if p is None or p.seed is None or p.greedy else noise_seed(p.seed, j)
                for p, j in zip(params, outputs, strict=True)
            ],
            num_logprobs=[p.logprobs if p is not None else None for p in params],
        )
        uses_penalties = (
            (col["repetition_penalty"] != 1.0)
            | (col["presence_penalty"] != 0.0)
            | (col["frequency_penalty"] != 0.0)
        )
        md.banned = self._banned_stop_tokens(rows, ends)
        md.allowed, md.bias = self._token_choices(params)
        if bool(uses_penalties.any()):
            md.repetition_penalty = col["repetition_penalty"]
            md.presence_penalty = col["presence_penalty"]
            md.frequency_penalty = col["frequency_penalty"]
            md.prompt_tokens = self._padded(rows, 0, ends)
            md.output_tokens = self._padded(rows, 1, ends)
        return md

    def _token_choices(
        self, params: list[SamplingParams | None]
    ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        """Each sample's ``allowed_token_ids`` as an [M, V] mask, and its ``logit_bias`` as
        (sample, token, bias) triples; None where no sample has one."""
        allowed = bias = None
        if any(p is not None and p.allowed_token_ids is not None for p in params):
            mask = np.ones((len(params), self.batch.vocab_size), dtype=bool)
            for i, p in enumerate(params):
                if p is not None and p.allowed_token_ids is not None:
                    mask[i] = False
                    mask[i, list(p.allowed_token_ids)] = True
            allowed = self._to_device(mask, torch.bool)
        triples = [(i, t, v) for i, p in enumerate(params) if p is not None
                   for t, v in p.logit_bias]
        if triples:
            rows_t, toks, values = zip(*triples, strict=True)
            bias = (self._to_device(np.asarray(rows_t)), self._to_device(np.asarray(toks)),
                    self._to_device(np.asarray(values), torch.float32))
        return allowed, bias

    def _banned_stop_tokens(
        self, rows: np.ndarray, ends: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Stop tokens (and EOS unless ignored) of samples still short of ``min_tokens``."""
        b = self.batch
        pairs: list[tuple[int, int]] = []
        for i, r in enumerate(rows):
            p = b.params[r]
            if p is None or p.min_tokens <= ends[i] - b.num_prompt_tokens[r]:
                continue
            pairs.extend((i, t) for t in stop_tokens(p, self.eos_token_ids)
                         if 0 <= t < b.vocab_size)
        if not pairs:
            return None
        idx = self._to_device(np.asarray(pairs, dtype=np.int64))
        return idx[:, 0], idx[:, 1]

    def _padded(self, rows: np.ndarray, part: int, ends: np.ndarray) -> torch.Tensor:
        """Prompt (part 0) or output (part 1, up to ``ends``) tokens of each row, padded with
        vocab_size."""
        b = self.batch
        lo = np.zeros(len(rows), dtype=np.int64) if part == 0 else b.num_prompt_tokens[rows]
        hi = b.num_prompt_tokens[rows] if part == 0 else ends
        width = max(1, int((hi - lo).max()))
        idx = lo[:, None] + np.arange(width)[None, :]  # [N, width]
        valid = idx < hi[:, None]
        toks = b.token_ids[rows[:, None], np.minimum(idx, b.max_model_len - 1)].astype(np.int64)
        return self._to_device(np.where(valid, toks, b.vocab_size))

    def _output(
        self,
        out: ModelRunnerOutput,
        rows: np.ndarray,
        n_per_row: np.ndarray,
        drafts: dict[str, list[int]],
        result: SamplerOutput,
    ) -> ModelRunnerOutput:
        """Per row, its samples up to and including the first that is not its draft at that
        position: a draft the model would itself have produced is accepted, and the sample
        after the accepted ones is the step's new token."""
        b = self.batch
        out.req_ids = [b.req_ids[r] for r in rows]  # type: ignore[misc]
        sampled = result.sampled.tolist()  # [M]
        ids = lps = None
        if result.logprob_ids is not None and result.logprobs is not None:
            ids, lps = result.logprob_ids.tolist(), result.logprobs.tolist()  # [M, 1 + k]
            out.logprobs = []
        at = 0
        for rid, r, n in zip(out.req_ids, rows, n_per_row.tolist(), strict=True):
            accepted = 1
            if n > 1:
                proposed = drafts[rid]
                while accepted < n and sampled[at + accepted - 1] == proposed[accepted - 1]:
                    accepted += 1
            out.sampled_token_ids.append(sampled[at : at + accepted])
            b.last_sampled[rid] = sampled[at + accepted - 1]
            if out.logprobs is not None:
                p = b.params[r]
                k = None if p is None else p.logprobs
                out.logprobs.append(
                    None if k is None or ids is None or lps is None
                    else [(ids[i][: 1 + k], lps[i][: 1 + k]) for i in range(at, at + accepted)]
                )
            at += n
        return out


def sample_positions(last: np.ndarray, n_per_row: np.ndarray) -> np.ndarray:
    """Flat token indices of the sampled positions: the ``n`` positions ending at ``last``, per
    row, in order. ``last``, ``n_per_row``: [N] -> [sum(n_per_row)]."""
    if (n_per_row == 1).all():
        return last
    starts = np.cumsum(n_per_row) - n_per_row  # [N] first sample of each row
    return np.repeat(last - n_per_row + 1 - starts, n_per_row) + np.arange(n_per_row.sum())
