"""One set-up call per rank, gathered with a bound, and short error text for reports.

Split from ``ray_executor`` so that the executor keeps to the group's life cycle; every wait
here is bounded and every failure names the rank it came from.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from pagedserve.controller.executor import WorkerGroupError

__all__ = ["gather_ranks", "short_error"]


def short_error(exc: BaseException, limit: int = 1000) -> str:
    """``Type: first line`` of an exception (a RayTaskError's cause, where it wraps one)."""
    exc = getattr(exc, "cause", None) or exc
    text = str(exc).strip().splitlines()
    head = text[0] if text else ""
    return f"{type(exc).__name__}: {head}"[:limit]


def gather_ranks(
    refs: list[Any],
    what: str,
    timeout_s: float,
    error: Callable[[int, str], WorkerGroupError],
) -> list[Any]:
    """``ray.get`` of one call per rank (``refs[rank]``), bounded by ``timeout_s``.

    A failure or a late rank raises ``error(rank, message)``. A ``load_model`` that fails for a
    reason of its own (not a Ray error) raises that reason: the checkpoint is bad (missing,
    unsupported), every rank says the same, and the user needs the loader's typed error."""
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    pending = list(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            late = sorted(rank_of[r] for r in pending)
            raise error(late[0], f"{what}: ranks {late} not done within {timeout_s:.1f} s")
        done, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except Exception as exc:
                cause = getattr(exc, "cause", None)
                if what == "load_model" and not isinstance(
                    cause, (ray.exceptions.RayError, type(None))
                ):
                    raise cause from None
                raise error(rank_of[ref], f"{what} failed: {short_error(exc)}") from exc
    return ray.get(refs, timeout=0)  # type: ignore[no-any-return]
