"""Decode-context-parallel (DCP) token layout: which rank stores a token, and where.

With ``W`` ranks, kernel block size ``B`` and interleave ``I`` (``B % I == 0``), one block id
covers a *virtual* block of ``V = B * W`` global positions. Inside it, runs of ``I`` consecutive
tokens go round-robin to the ranks; each rank packs its runs densely into its own physical copy
of the block. ``I = 1`` deals tokens one by one, ``I = B`` fills rank 0's block first.

:class:`CPLayout` names one rank's place in that layout. Every function works on Python ints
and elementwise on integer torch tensors, so the reference kernel, the tests and the workers'
slot mapping share one formula. Only ``//``, ``%``, ``*``, ``+`` and ``clip`` are used (numpy
arrays therefore work too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.kernels.errors import KernelArgumentError


@dataclass(frozen=True, slots=True)
class CPLayout:
    """Rank ``rank`` of ``size`` decode-context-parallel ranks, tokens dealt out in runs of
    ``interleave``. The default, one rank, is no context parallelism. Whether ``interleave``
    divides the block size is checked where the block size is known."""

    rank: int = 0
    size: int = 1
    interleave: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise KernelArgumentError(
                f"need 0 <= cp_rank < cp_size, got rank {self.rank}, size {self.size}"
            )
        if self.interleave < 1:
            raise KernelArgumentError(f"cp_interleave must be >= 1, got {self.interleave}")


NO_CP = CPLayout()
"""One rank: no context parallelism (the default everywhere a layout is taken)."""


def _check(block_size: int, cp_size: int, interleave: int) -> None:
    if cp_size < 1 or interleave < 1 or block_size < 1:
        raise ValueError(
            f"need block_size, cp_size, interleave >= 1, got {block_size}, {cp_size}, {interleave}"
        )
    if block_size % interleave != 0:
        raise ValueError(
            f"block_size ({block_size}) must be a multiple of cp_interleave ({interleave})"
        )


def cp_owner_and_offset(
    pos: Any, block_size: int, cp_size: int, interleave: int
) -> tuple[Any, Any]:
    """Global position -> (owner rank, offset inside the owner's copy of the block).

    The block id itself is ``block_table[pos // (block_size * cp_size)]`` on every rank, so the
    physical slot on the owner is ``block_id * block_size + offset``.
    """
    _check(block_size, cp_size, interleave)
    off = pos % (block_size * cp_size)
    owner = (off // interleave) % cp_size
    local = (off // (cp_size * interleave)) * interleave + off % interleave
    return owner, local


def cp_global_position(
    local_index: Any, rank: int, block_size: int, cp_size: int, interleave: int
) -> Any:
    """A rank's local key index -> global position of the token stored there.

    Local index ``j`` is offset ``j % B`` of the rank's copy of block ``block_table[j // B]``.

    Inverse of :func:`cp_owner_and_offset` for the rank's own slots. Positions at or past the
    sequence length are padding (the rank's last block may be partly filled).
    """
    _check(block_size, cp_size, interleave)
    vblock = local_index // block_size
    local = local_index % block_size
    off = (local // interleave) * (cp_size * interleave) + rank * interleave + local % interleave
    return vblock * (block_size * cp_size) + off


def cp_local_seq_len(seq_len: Any, rank: int, cp_size: int, interleave: int) -> Any:
    """How many of the first ``seq_len`` global positions rank ``rank`` stores.

    Because the local packing is monotone in the global position, these are exactly the rank's
    local key indices ``0 .. cp_local_seq_len - 1``.
    """
    full = (seq_len // (interleave * cp_size)) * interleave
    rem = seq_len - full * cp_size - rank * interleave
    if isinstance(rem, int):
        rem = min(max(rem, 0), interleave)
    else:
        rem = rem.clip(0, interleave)
    return full + rem
