"""The sampler's argmax (``csrc/argmax_cpu.cpp``) against torch's ``argmax(-1)``, index for index:
ties (the first index wins), NaN (the first NaN wins), infinities, rows shorter than a run of
lanes and tails past the last run, strided rows, and the dispatch's fallbacks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.kernels import cpu as cpu_kernels
from pagedserve.kernels.argmax import argmax, argmax_ref


@pytest.fixture(autouse=True)
def _built() -> None:
    assert cpu_kernels.cpu_ops() is not None, "the compiled CPU kernels did not build"


# A few values drawn over and over, so that rows hold ties (and -0.0 beside 0.0) everywhere.
VALUES = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, 2.5, float("inf"), float("-inf"),
                          float("nan"), 3.0e38, -3.0e38, 1e-45])


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.lists(VALUES, min_size=1, max_size=70), min_size=1, max_size=4),
       width=st.integers(1, 70))
def test_matches_torch_on_ties_nan_and_infinities(rows: list[list[float]], width: int) -> None:
    x = torch.tensor([(r * width)[:width] for r in rows], dtype=torch.float32)
    assert torch.equal(cpu_kernels.cpu_ops().argmax_rows(x), argmax_ref(x))


@pytest.mark.parametrize("n,v", [(1, 1), (3, 15), (2, 16), (5, 17), (64, 49152), (7, 1000)])
def test_matches_torch_on_logits(n: int, v: int) -> None:
    g = torch.Generator().manual_seed(v)
    x = torch.randn(n, v, generator=g)
    # the maximum planted again, later in the row: the first copy must win
    top = x.argmax(-1)
    x[torch.arange(n), (top + v // 2) % v] = x.max(-1).values
    assert torch.equal(cpu_kernels.cpu_ops().argmax_rows(x), argmax_ref(x))
    assert torch.equal(argmax(x), argmax_ref(x))


def test_strided_rows_and_late_nan() -> None:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 300, generator=g)
    x = wide[:, :250]  # rows 300 apart
    x[2, 249] = float("nan")  # in the tail, after a larger value in the runs
    x[4, 40] = float("nan")
    x[4, 7] = float("nan")
    assert torch.equal(argmax(x), argmax_ref(x))
    assert argmax(x)[2].item() == 249 and argmax(x)[4].item() == 7


def test_dispatch_falls_back_where_the_kernel_does_not_serve() -> None:
    for x in (torch.randn(4, 9).double(), torch.randn(4, 9).bfloat16(), torch.randn(9, 4).t(),
              torch.zeros(0, 5)):
        assert torch.equal(argmax(x), argmax_ref(x))
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.cpu_ops().argmax_rows(torch.randn(4, 9).double())
