"""Per-rank block tables: request row -> physical KV block ids, and the token -> slot mapping.

One ``BlockTable`` per KV-cache group. Rows are edited on a host numpy buffer as the scheduler's
deltas arrive and committed to the device once per step.

Block sizes: a block holds ``B`` tokens per rank (the kv tensor's block dim); with decode context
parallelism of ``W`` ranks the controller's block id covers ``V = B * W`` tokens of the sequence
(the virtual block), and every rank stores its share of them in its own copy of that block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedserve.kernels import NO_CP, CPLayout, cp_owner_and_offset
from pagedserve.workers.buffers import HostDeviceBuffer


class BlockTable:
    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        block_size: int,
        device: torch.device,
        *,
        cp: CPLayout = NO_CP,
    ) -> None:
        """``block_size`` is the per-rank block size ``B``."""
        if block_size % cp.interleave:
            raise ValueError(f"cp interleave {cp.interleave} does not divide block {block_size}")
        self.block_size = block_size
        self.cp = cp
        self.table = HostDeviceBuffer(
            max_num_reqs, max_num_blocks_per_req, dtype=torch.int32, device=device
        )
        self.np = self.table.np  # [max_reqs, max_blocks] block ids
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)  # used columns per row

    # Row operations (host side only; commit() publishes them) -------------------------------

    def append_row(self, block_ids: Sequence[int], row: int) -> None:
        if len(block_ids) == 0:
            return
        ids = np.asarray(block_ids, dtype=np.int32)
        start = self.num_blocks[row]
        if start + len(ids) > self.np.shape[1]:
            raise ValueError(
                f"row {row}: {start + len(ids)} blocks exceed width {self.np.shape[1]}"
            )
        self.np[row, start : start + len(ids)] = ids
        self.num_blocks[row] = start + len(ids)

    def add_row(self, block_ids: Sequence[int], row: int) -> None:
        self.clear_row(row)
        self.append_row(block_ids, row)

    def clear_row(self, row: int) -> None:
        self.np[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0

    def truncate_row(self, row: int, num_blocks: int) -> None:
        """Keep the row's first ``num_blocks`` blocks (the controller freed the rest)."""
        n = self.num_blocks[row]
        if num_blocks < n:
            self.np[row, num_blocks:n] = 0
            self.num_blocks[row] = num_blocks

    def move_row(self, src: int, dst: int) -> None:
        n = self.num_blocks[src]
        self.np[dst, :n] = self.np[src, :n]
        self.np[dst, n : self.num_blocks[dst]] = 0
        self.num_blocks[dst] = n

    def clear(self) -> None:
        self.np[:] = 0
        self.num_blocks[:] = 0

    # Per-step ------------------------------------------------------------------------------

    def token_capacity(self, rows: np.ndarray) -> np.ndarray:
        """[N] positions the rows' blocks hold: a controller block covers ``B * W`` of them."""
        return self.num_blocks[rows].astype(np.int64) * self.block_size * self.cp.size

    def slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Physical slot of each token on this rank, or -1 when another CP rank stores it.

        ``req_indices[t]`` is the row of token t, ``positions[t]`` its position in the sequence.
        """
        req_indices = np.asarray(req_indices, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        b, cp = self.block_size, self.cp
        owner, local = cp_owner_and_offset(positions, b, cp.size, cp.interleave)
        slots = self.np[req_indices, positions // (b * cp.size)].astype(np.int64) * b + local
        return np.where(owner == cp.rank, slots, -1)

    def commit(self, num_reqs: int) -> torch.Tensor:
        """Publish the first ``num_reqs`` rows; returns the device table ``[num_reqs, width]``."""
        return self.table.commit(num_reqs)


class MultiGroupBlockTable:
    """One ``BlockTable`` per KV-cache group; block ids arrive as one list per group."""

    def __init__(self, tables: list[BlockTable]) -> None:
        self.tables = tables

    def __getitem__(self, group: int) -> BlockTable:
        return self.tables[group]

    def __len__(self) -> int:
        return len(self.tables)

    def append_row(self, block_ids: Sequence[Sequence[int]], row: int) -> None:
        for table, ids in zip(self.tables, block_ids, strict=True):
            table.append_row(ids, row)

    def add_row(self, block_ids: Sequence[Sequence[int]], row: int) -> None:
        for table, ids in zip(self.tables, block_ids, strict=True):
            table.add_row(ids, row)

    def truncate_row(self, row: int, num_blocks: int) -> None:
        for table in self.tables:
            table.truncate_row(row, num_blocks)

    def clear_row(self, row: int) -> None:
        for table in self.tables:
            table.clear_row(row)

    def move_row(self, src: int, dst: int) -> None:
        for table in self.tables:
            table.move_row(src, dst)
