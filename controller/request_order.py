"""Where a request goes in the scheduler's waiting queue and running list, per policy.

``fcfs``: the waiting queue in arrival order (a preempted request back at its head), running
requests in admission order. ``priority``: both kept sorted by (``priority``, arrival), so the
most urgent waiting request is admitted first and the end of the running list, where the
scheduler takes its KV cache victims, is always the least urgent running request.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque

from pagedserve.controller.request import Request

__all__ = ["enqueue", "start_running"]


def _rank(req: Request) -> tuple[int, float]:
    return req.priority, req.arrival_time


def enqueue(waiting: deque[Request], req: Request, policy: str, *, front: bool) -> None:
    """Into ``waiting``: at its head or tail (``fcfs``), or in its rank's place (``priority``;
    ``front`` puts it before requests of equal rank)."""
    if policy == "fcfs":
        (waiting.appendleft if front else waiting.append)(req)
        return
    keys = [_rank(r) for r in waiting]
    waiting.insert((bisect_left if front else bisect_right)(keys, _rank(req)), req)


def start_running(running: list[Request], req: Request, policy: str) -> None:
    """Into ``running``: last (``fcfs``), or after every request of its rank or a better one."""
    if policy == "fcfs":
        running.append(req)
    else:
        running.insert(bisect_right([_rank(r) for r in running], _rank(req)), req)
