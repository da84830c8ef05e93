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

__all__ = ["find_dead_rank", "find_silent_rank", "gather_ranks", "short_error"]


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


def find_dead_rank(
    run_refs: dict[Any, int], wait_s: float, exclude: int | None, died_only: bool
) -> tuple[int, int, str] | None:
    """``(priority, rank, message)`` of a rank (not ``exclude``) whose ``run`` ref has ended:
    priority 0 the actor died, 1 its loop raised, 2 its loop returned; the most telling first.
    Waits up to ``wait_s`` for the first to end; None if all run (or, ``died_only``, none died).
    """
    refs = [ref for ref, rank in run_refs.items() if rank != exclude]
    if not refs:
        return None
    if wait_s > 0:
        ray.wait(refs, num_returns=1, timeout=wait_s)
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    found: list[tuple[int, int, str]] = []
    for ref in done:
        rank = run_refs[ref]
        try:
            result = ray.get(ref, timeout=0)
            found.append((2, rank, f"its step loop returned {result!r}"))
        except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError) as exc:
            found.append((0, rank, f"the worker actor died ({short_error(exc)})"))
        except Exception as exc:
            found.append((1, rank, f"its step loop failed ({short_error(exc)})"))
    if died_only:
        found = [f for f in found if f[0] == 0]
    return min(found) if found else None


def find_silent_rank(actors: list[Any], timeout_s: float) -> tuple[int, str] | None:
    """``(rank, message)`` of the first rank that does not answer a ping within ``timeout_s``
    (its process or its node is gone, though Ray may not know yet), or None if all answer.
    The ping runs on the actor's control thread, so a rank busy in its loop still answers."""
    if not actors:
        return None
    refs = {actor.ping.remote(): rank for rank, actor in enumerate(actors)}
    done, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    for ref in sorted(done, key=lambda r: refs[r]):
        try:
            ray.get(ref, timeout=0)
        except Exception as exc:
            return refs[ref], f"the worker does not answer ({short_error(exc)})"
    if len(pending) > 1:
        # A loaded host may answer late: give the silent ones as long again before blaming the
        # lowest rank, so that a slow survivor is not taken for the lost one.
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
    if pending:
        rank = min(refs[r] for r in pending)
        return rank, f"the worker did not answer a ping within {timeout_s:.1f} s (its process or " \
            "node is gone)"
    return None
