"""A CPU rank's torch thread count is its share of the node's cores."""

from __future__ import annotations

from pagedserve.workers import cpu_process


def test_share_cores_divides_the_usable_cpus(monkeypatch) -> None:
    import torch

    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_process, "usable_cpus", lambda: 8)
    try:
        assert cpu_process.share_cores(2) == 4 and torch.get_num_threads() == 4
        assert cpu_process.share_cores(16) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
