"""``CpuPool``: the bounded thread pool that keeps the CPU-heavy parts of a request off the
event loop (tokenizing, chat templates, detokenizing, building and rendering responses).

The event loop answers every connection; a 20 MB prompt tokenized on it stalled ``/health``
for seconds (#27). In a thread the tokenizers' Rust code runs without the GIL, and Python code
yields the GIL to the loop every switch interval (5 ms), so the loop keeps answering.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

__all__ = ["CpuPool"]

P = ParamSpec("P")
T = TypeVar("T")


class CpuPool:
    """``await pool.run(fn, *args)`` runs ``fn`` on one of ``workers`` threads (created as
    needed). Calls beyond that wait in the pool's queue, in order; each caller is one request
    in progress, so the queue is as bounded as the requests are."""

    def __init__(self, workers: int = 2) -> None:
        self.workers = workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagedserve-cpu")

    async def run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Stop taking work; queued calls are cancelled, running ones finish on their own."""
        self._pool.shutdown(wait=False, cancel_futures=True)
