"""The torch thread count of a rank that computes on the CPU.

Ray starts a 1-CPU actor with ``OMP_NUM_THREADS=1``, so torch would compute on one core of a
machine that has more; each rank takes its share of the cores of its node instead.
"""

from __future__ import annotations

import os

import torch


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def share_cores(ranks_on_node: int) -> int:
    """Give torch this rank's share of the node's cores; returns the thread count."""
    threads = max(1, usable_cpus() // max(1, ranks_on_node))
    torch.set_num_threads(threads)
    return threads
