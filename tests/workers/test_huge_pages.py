"""Weights in 2 MiB pages: the memory the kernel reports under a collapsed tensor
(``/proc/self/smaps``), the contents unchanged, and every tensor a loaded model computes with
found by the walk over its modules."""

from __future__ import annotations

import platform
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pagedserve.kernels.quant_linear import quantize_int8
from pagedserve.workers import huge_pages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux huge pages")


def huge_bytes_under(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings that overlap t's storage, in bytes (an madvise splits a
    mapping, so the storage may span several)."""
    s = t.untyped_storage()
    start, end = s.data_ptr(), s.data_ptr() + s.nbytes()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and start < hi
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


def thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.exists() else "[never]"
    return text.split("[")[1].split("]")[0]


@linux
def test_collapse_keeps_contents_and_moves_them_into_huge_pages() -> None:
    if thp_mode() == "never":
        pytest.skip("transparent huge pages are off on this host")
    # float32, 6 MiB and 48 KiB: four windows or, where it starts in a window's last 48 KiB,
    # five (about one start in forty)
    x = torch.randn(3 * huge_pages.HUGE_PAGE // 4 + 12345)
    want = x.clone()
    if tuple(int(p) for p in re.findall(r"\d+", platform.release())[:2]) < (6, 1):
        pytest.skip("MADV_COLLAPSE needs Linux 6.1")
    done = huge_pages.collapse([x, x[10:]])  # a view adds no window of its own
    assert torch.equal(x, want)
    windows = huge_pages._windows([x])
    assert len(windows) in (4, 5)
    assert done % huge_pages.HUGE_PAGE == 0 and done <= len(windows) * huge_pages.HUGE_PAGE
    assert huge_bytes_under(x) >= huge_pages.HUGE_PAGE


def test_windows_cover_each_storage_once() -> None:
    x = torch.zeros(huge_pages.HUGE_PAGE // 4 * 3)  # 6 MiB: 3 or 4 windows
    starts = huge_pages._windows([x, x[1:], x.view(3, -1)])
    assert starts == sorted(set(starts)) and len(starts) in (3, 4)
    assert all(s % huge_pages.HUGE_PAGE == 0 for s in starts)
    assert starts[0] <= x.data_ptr() < starts[0] + huge_pages.HUGE_PAGE


def test_module_tensors_reaches_packed_and_quantized_weights() -> None:
    m = nn.Sequential(nn.Linear(64, 32, bias=False))
    m[0].register_buffer("table", torch.zeros(4))
    m[0].packed = torch.ones(2, 2)
    m[0].quant = quantize_int8(torch.randn(32, 64), dynamic=False)
    m.fused = [(torch.full((3,), 7.0),)]
    found = {id(t) for t in huge_pages.module_tensors(m)}
    held = [m[0].weight, m[0].table, m[0].packed, m[0].quant.qweight, m[0].quant.scale,
            m.fused[0][0]]
    assert all(id(t) in found for t in held)


def test_a_loaded_model_holds_every_tensor_its_layers_compute_with(tmp_path) -> None:
    from helpers.checkpoints import make_checkpoint

    from pagedserve.parallel.state import ParallelState
    from pagedserve.workers.loader import load_model

    ckpt = make_checkpoint("llama", tmp_path / "tiny")
    model, _, _ = load_model(ckpt, "float32", torch.device("cpu"), ParallelState(0, 1))
    found = {t.untyped_storage().data_ptr() for t in huge_pages.module_tensors(model)}
    used = [t for w in model.model.fused if w is not None for t in (*w.linears, w.input_norm)]
    assert used and all(t.untyped_storage().data_ptr() in found for t in used)
