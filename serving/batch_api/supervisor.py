"""A coroutine on a thread of its own, with its own event loop, started again when it dies.

The batch runner lives here so that it starts and resumes whether or not the ASGI server runs
lifespan events, and so that a bug it meets costs a restart (the batches' state is on disk;
a fresh run resumes them as a server start does), not the Batch API for the server's lifetime.
Restarts back off (``backoff_s`` doubled per recent death); past ``max_restarts`` deaths
within ``window_s`` it gives up, and ``alive`` turns False for ``/health`` to report.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["LoopThread"]

logger = logging.getLogger(__name__)


class LoopThread:
    """Runs ``main()`` on a daemon thread until ``stop()``; restarts it when it raises."""

    def __init__(
        self, name: str, main: Callable[[], Coroutine[Any, Any, None]], *,
        backoff_s: float = 1.0, max_restarts: int = 5, window_s: float = 600.0,
    ) -> None:
        self.name = name
        self._main = main
        self.backoff_s = backoff_s
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.restarts = 0
        """Times ``main`` was started again after it died."""
        self.failure: str | None = None
        """Why it gave up (None while it runs or after a clean stop)."""
        self._deaths: list[float] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._thread_main, name=name, daemon=True)

    @property
    def alive(self) -> bool:
        """Running, or stopped on purpose; False once it has given up (or never started)."""
        return self._stopping.is_set() or self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def call_soon(self, callback: Callable[[], Any]) -> None:
        """Run ``callback`` on the loop (from any thread); dropped while there is no loop."""
        with self._lock:
            loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(callback)
            except RuntimeError:  # closing
                pass

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancel ``main`` (its ``finally`` runs) and wait for the thread."""
        with self._lock:
            self._stopping.set()
            loop, task = self._loop, self._task
        if loop is not None and task is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:
                pass
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _thread_main(self) -> None:
        while True:
            loop = asyncio.new_event_loop()
            with self._lock:
                if self._stopping.is_set():
                    loop.close()
                    return
                self._loop = loop
                self._task = loop.create_task(self._main())
                task = self._task
            try:
                loop.run_until_complete(task)
                return  # main returned, or was cancelled by stop()
            except asyncio.CancelledError:
                return
            except Exception as exc:
                logger.exception("%s died", self.name)
                reason = f"{type(exc).__name__}: {exc}"
            finally:
                with self._lock:
                    self._loop = self._task = None
                loop.close()
            if not self._may_restart(reason):
                return
            self.restarts += 1

    def _may_restart(self, reason: str) -> bool:
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < self.window_s] + [now]
        if len(self._deaths) > self.max_restarts:
            self.failure = (f"died {len(self._deaths)} times within {self.window_s:.0f} s, "
                            f"last: {reason}")
            logger.error("%s gave up: %s", self.name, self.failure)
            return False
        delay = self.backoff_s * 2 ** (len(self._deaths) - 1)
        logger.warning("%s restarts in %.1f s", self.name, delay)
        return not self._stopping.wait(delay)
