"""``JSONInTurns``: a route class whose large JSON bodies are parsed one per event-loop turn.

FastAPI parses a body with ``json.loads`` on the event loop, and the C parser holds the GIL
throughout (about 3 ms per 2 MB prompt, 17 ms per MiB of token ids), so a thread would not
help. Sixteen 2 MB bodies that finish arriving together were parsed back to back in one turn
of the loop, and a ``/health`` that arrived meanwhile waited for all of them. Here a large body
is parsed holding the app's turn lock, which it keeps until the loop has run once more: every
callback that was ready meanwhile (``/health``) runs between two large parses.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

__all__ = ["JSONInTurns", "LARGE_BODY_BYTES"]

# Below this a body parses in well under a millisecond: no turn is taken.
LARGE_BODY_BYTES = 256 << 10


class _InTurnsRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            lock: asyncio.Lock | None = getattr(self.app.state, "json_turn", None)
            if lock is None or len(body) < LARGE_BODY_BYTES:
                self._json = json.loads(body)
            else:
                async with lock:
                    self._json = json.loads(body)
                    await asyncio.sleep(0)  # the loop turns once before the next parse
        return self._json


class JSONInTurns(APIRoute):
    """An ``APIRoute`` whose request parses large JSON bodies in turns (with the app's
    ``app.state.json_turn`` lock; without one, as FastAPI does)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def in_turns(request: Request) -> Response:
            return await handler(_InTurnsRequest(request.scope, request.receive))

        return in_turns
