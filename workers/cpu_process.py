"""Process settings for a rank that computes on the CPU: the allocator and the thread count.

- **Allocator.** glibc serves every allocation above its mmap threshold (128 KiB to 32 MiB) with a
  fresh ``mmap`` and returns it with ``munmap`` on free. A CPU step allocates the same large
  tensors again in every layer (the gathered K/V, the MLP activations), so each of them is
  page-faulted in anew: measured on a 2-core machine, a 42 MB gather through the block table
  took 41 ms from fresh pages and 10 ms from reused ones. Switching mmap off and never trimming
  the heap keeps freed memory in the process for the next layer (what tcmalloc or jemalloc, which
  vLLM's CPU build preloads, do by default). The process's resident size stays at its peak.
- **Threads.** Ray starts a 1-CPU actor with ``OMP_NUM_THREADS=1``, so torch would compute on one
  core of a machine that has more; each rank takes its share of the cores of its node instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Make glibc's malloc reuse freed memory instead of unmapping it; False where the C library
    is not glibc (nothing changes there)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    if not ok:
        logger.warning("mallopt refused the settings; large CPU tensors will be page-faulted in "
                       "anew every step")
    return ok


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
