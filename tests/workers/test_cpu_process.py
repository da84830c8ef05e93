"""The CPU rank's process settings: glibc keeps freed memory for reuse, and the torch thread
count is the rank's share of the node's cores."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from pagedserve.workers import cpu_process


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_large_blocks_are_reused_not_unmapped() -> None:
    # In a fresh process: after the settings, a freed 64 MB tensor's pages stay mapped, so the
    # next allocation of that size comes back at the same address with no new mapping.
    code = (
        "import torch\n"
        "from pagedserve.workers.cpu_process import keep_freed_memory\n"
        "assert keep_freed_memory()\n"
        "a = torch.ones(16 << 20); p = a.data_ptr(); del a\n"
        "b = torch.empty(16 << 20); print(b.data_ptr() == p, float(b[:4].sum()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    # Same block, and its contents were not handed back to the kernel (which would zero them).
    assert out == ["True", "4.0"]


def test_share_cores_divides_the_usable_cpus(monkeypatch) -> None:
    import torch

    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_process, "usable_cpus", lambda: 8)
    try:
        assert cpu_process.share_cores(2) == 4 and torch.get_num_threads() == 4
        assert cpu_process.share_cores(16) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
