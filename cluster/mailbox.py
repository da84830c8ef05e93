"""A queue that any thread fills and one ZeroMQ IO thread empties, woken through its poller."""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Generic, TypeVar

import zmq

__all__ = ["Mailbox"]

T = TypeVar("T")
_ids = itertools.count()


class Mailbox(Generic[T]):
    """``put`` from any thread; the IO thread registers ``waker`` in its poller and calls
    ``drain`` when it fires. ZeroMQ sockets are not thread-safe, so the wake-up travels over an
    inproc PUSH/PULL pair whose sending side is used under a lock."""

    def __init__(self, ctx: zmq.Context, name: str) -> None:
        addr = f"inproc://pagedserve-{name}-{next(_ids)}"
        self.waker = ctx.socket(zmq.PULL)
        self.waker.bind(addr)
        self._tx = ctx.socket(zmq.PUSH)
        self._tx.setsockopt(zmq.LINGER, 0)
        self._tx.connect(addr)
        self._lock = threading.Lock()
        self._items: deque[T] = deque()
        self._closed = False

    def put(self, item: T) -> None:
        with self._lock:
            self._items.append(item)
            if self._closed:
                return
            try:
                self._tx.send(b"", flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # wake-ups are queued already, and each drain takes every item

    def drain(self) -> list[T]:
        """Every item put so far (IO thread only)."""
        while True:
            try:
                self.waker.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
        with self._lock:
            items = list(self._items)
            self._items.clear()
        return items

    def put_back(self, items: list[T]) -> None:
        """Return what could not be sent, ahead of newer items, for the next wake-up."""
        with self._lock:
            self._items.extendleft(reversed(items))

    def close(self) -> None:
        """No more wake-ups (the context is about to go)."""
        with self._lock:
            self._closed = True
