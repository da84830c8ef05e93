"""When to rebuild a failed worker group, and when to give up."""

from __future__ import annotations

import time

__all__ = ["RestartPolicy"]


class RestartPolicy:
    """Exponential backoff over recent failures; dead after more than ``max_restarts``
    failures within ``window_s``. Pure bookkeeping: the engine core does the rebuilding.

    ``max_failures_per_request``: a request that was running on a group that failed more
    often than this is failed alone (``RequestFailedError``) instead of resumed once more. A
    request that kills its workers whenever it runs would otherwise take the engine's whole
    restart budget, and every other request with it; 2 leaves the engine a restart to spare
    under the default cap.
    """

    def __init__(
        self,
        max_restarts: int = 3,
        window_s: float = 600.0,
        backoff_s: float = 1.0,
        backoff_max_s: float = 30.0,
        max_failures_per_request: int = 2,
    ) -> None:
        if max_failures_per_request < 0:
            raise ValueError(
                f"max_failures_per_request must be >= 0, got {max_failures_per_request}"
            )
        self.max_failures_per_request = max_failures_per_request
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self._failures: list[float] = []

    def on_failure(self, now: float | None = None) -> float | None:
        """Count a failure. Returns the delay before the rebuild, or None: give up."""
        now = time.monotonic() if now is None else now
        self._failures = [t for t in self._failures if now - t < self.window_s]
        self._failures.append(now)
        recent = len(self._failures)
        if recent > self.max_restarts:
            return None
        return min(self.backoff_s * 2 ** (recent - 1), self.backoff_max_s)

    @property
    def recent_failures(self) -> int:
        return len(self._failures)
