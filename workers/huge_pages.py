"""The weights in 2 MiB pages (Linux transparent huge pages), on the CPU.

A decode step at a small batch streams every weight once, so its speed is the speed of that
stream. Over 4 KiB pages the stream pays a TLB miss every 4 KiB, and the hardware prefetcher
stops at each page's end, so the same kernel streams slower from 4 KiB pages
(``docs/results/performance.md`` section 12 has the measurements). Anonymous memory gets
2 MiB pages only where it is asked for (the usual ``madvise`` setting of
``/sys/kernel/mm/transparent_hugepage/enabled``), so the loader collapses the weights in place
once they are loaded and packed (``collapse``: ``MADV_COLLAPSE``, Linux 6.1+), every 2 MiB
window that holds some weight. The KV pool stays in 4 KiB pages: asked for 2 MiB pages before
its first write (``MADV_HUGEPAGE``), a fresh 1 GiB pool cost up to 1.6 s of the kernel's
compaction on this host, at every engine start.

The collapse is advice: where the kernel refuses (an older kernel, huge pages off, not Linux)
the memory stays in 4 KiB pages, works the same, and the log says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import sys
from collections.abc import Iterable

import torch
from torch import nn

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_COLLAPSE = 25


def _libc_madvise():  # type: ignore[no-untyped-def]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


def madvise(start: int, length: int, advice: int) -> int:
    """0, or the errno of ``madvise(start, length, advice)`` (ENOSYS off Linux)."""
    if _madvise is None:
        return errno.ENOSYS
    return 0 if _madvise(start, length, advice) == 0 else ctypes.get_errno()


def module_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the model's modules hold: parameters, buffers, and those in their other
    attributes (packed copies, quantized weights, the compiled layers' arguments)."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def take(v: object) -> None:
        if isinstance(v, torch.Tensor):
            found[id(v)] = v
        elif isinstance(v, nn.Module) or id(v) in seen:
            return  # modules come through model.modules()
        elif isinstance(v, (list, tuple, dict)):
            seen.add(id(v))
            for x in v.values() if isinstance(v, dict) else v:
                take(x)
        elif type(v).__module__.startswith("pagedserve."):  # a holder of ours (Int8Weight, ...)
            seen.add(id(v))
            names = getattr(type(v), "__slots__", ()) or vars(v)
            for name in names:
                take(getattr(v, name, None))

    for m in model.modules():
        for v in vars(m).values():
            take(v)
    return list(found.values())


def _windows(tensors: Iterable[torch.Tensor]) -> list[int]:
    """The 2 MiB-aligned windows (their starts) that hold some byte of a CPU tensor's
    storage, in address order."""
    starts: set[int] = set()
    for t in tensors:
        if t.device.type != "cpu" or t.is_mkldnn:
            continue
        s = t.untyped_storage()
        lo, hi = s.data_ptr(), s.data_ptr() + s.nbytes()
        starts.update(range(lo // HUGE_PAGE * HUGE_PAGE, hi, HUGE_PAGE))
    return sorted(starts)


def collapse(tensors: Iterable[torch.Tensor]) -> int:
    """Move the memory of ``tensors`` into 2 MiB pages where the kernel can; returns the bytes
    of the windows now in them."""
    done, refused = 0, {}
    for start in _windows(tensors):
        err = madvise(start, HUGE_PAGE, MADV_COLLAPSE)
        if err == 0:
            done += HUGE_PAGE
        else:
            refused[err] = refused.get(err, 0) + 1
    if refused:
        # A window at the edge of a mapping is refused (EINVAL) even where the rest works.
        log.info("huge pages: the kernel kept %d windows of 2 MiB in 4 KiB pages (errno %s)",
                 sum(refused.values()), sorted(refused))
    return done

