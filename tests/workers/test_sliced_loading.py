"""A tensor-parallel rank reads only its own slices of the safetensors files."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedserve.parallel.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from pagedserve.parallel.state import ParallelState
from pagedserve.workers.loader import CheckpointTensor, iterate_weights


class RecordingSlice:
    """A safetensors slice that records every index read through it."""

    def __init__(self, inner, reads: list) -> None:
        self.inner, self.reads = inner, reads

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        self.reads.append(index)
        return self.inner[index]


def test_rank_reads_only_its_rows_and_columns(tmp_path: Path) -> None:
    full = {"col": torch.randn(8, 6), "row": torch.randn(6, 8)}
    save_file(full, str(tmp_path / "model.safetensors"))
    reads: list = []
    col = ColumnParallelLinear(6, 8, bias=False, state=ParallelState(1, 2))
    row = RowParallelLinear(8, 6, bias=False, state=ParallelState(1, 2))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        for name, layer in (("col", col), ("row", row)):
            lazy = CheckpointTensor(RecordingSlice(f.get_slice(name), reads))
            layer.weight.weight_loader(layer.weight, lazy)
    assert reads == [(slice(4, 8), slice(None)), (slice(None), slice(4, 8))]
    assert torch.equal(col.weight.data, full["col"][4:])
    assert torch.equal(row.weight.data, full["row"][:, 4:])


def test_replicated_parameters_read_the_whole_tensor(tmp_path: Path) -> None:
    w = torch.randn(3, 5)
    save_file({"norm.weight": w}, str(tmp_path / "model.safetensors"))
    param = torch.nn.Parameter(torch.empty(3, 5))
    for name, lazy in iterate_weights(tmp_path):
        assert name == "norm.weight" and lazy.shape == torch.Size([3, 5])
        default_weight_loader(param, lazy)
    assert torch.equal(param.data, w)
