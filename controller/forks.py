"""Parallel sampling (``n > 1``): a request forks into its ``n`` sequences.

A *fork parent* computes the prompt minus its last token, then ``n`` children share all its
blocks (kv's copy-on-write ``fork``). Each child computes the last prompt token itself, so the
first write into the shared partial block copies it, and then samples on its own. A child is
new to the workers in that step, so the copy-on-write replacement reaches them inside the
child's full ``NewRequestData`` block list. (Should a request the workers already hold ever get
a block replaced, it is dropped and re-sent in full in the same step.) Under the ``reserve``
policy the parent is skipped and the children run as independent requests.
"""

from __future__ import annotations

from collections import deque

from pagedserve.controller.request import Request, RequestStatus
from pagedserve.controller.request_order import enqueue
from pagedserve.kv import KVCacheManager

__all__ = ["dissolve_parent", "fork"]


def dissolve_parent(requests: dict[str, Request], waiting: deque[Request], policy: str,
                    parent: Request, *, at_front: bool) -> None:
    """Replace an unadmitted fork parent by its children in the waiting queue."""
    requests.pop(parent.request_id, None)
    parent.status = RequestStatus.FINISHED_STOPPED
    for child in reversed(parent.children) if at_front else parent.children:
        enqueue(waiting, child, policy, front=at_front)
    parent.children = []


def fork(kv: KVCacheManager, requests: dict[str, Request], running: list[Request],
         parent: Request) -> None:
    """Children take over the parent's blocks and its seat in the running list; the parent
    ends (the caller has the workers drop it)."""
    children = parent.children
    for child in children:
        kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = RequestStatus.RUNNING
    idx = running.index(parent)
    running[idx : idx + 1] = children
    kv.free(parent)
    requests.pop(parent.request_id, None)
    parent.status = RequestStatus.FINISHED_STOPPED
    parent.children = []
