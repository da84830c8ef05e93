"""``Driven``: an ``EngineCore`` as tests like to drive it, step by step with cumulative outputs.

``add_request(id, prompt_ids, params, prompt=..., cache_salt=..., priority=...,
final_only=...)`` builds the ``AddRequest``; ``step()`` and ``abort_request()`` fold the
engine's deltas into cumulative ``RequestOutput``s through the package's own
``OutputCollector``. Everything else is the engine's.
"""

from __future__ import annotations

from typing import Any

from pagedserve.controller.outputs import OutputCollector
from pagedserve.messages import AddRequest, RequestOutput, SamplingParams


class Driven:
    def __init__(self, engine: Any) -> None:
        self.__dict__["core"] = engine
        self.__dict__["collector"] = OutputCollector()

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        final_only: bool = False,
    ) -> None:
        req = AddRequest(request_id, list(prompt_token_ids), params or SamplingParams(), prompt,
                         cache_salt, priority, final_only=final_only)
        self.core.add_request(req, arrival_time)
        self.collector.expect(req)

    def step(self) -> list[RequestOutput]:
        return self.collector.feed(self.core.step())

    def abort_request(self, request_id: str) -> RequestOutput | None:
        delta = self.core.abort_request(request_id)
        return None if delta is None else self.collector.feed([delta])[0]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.core, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.core, name, value)


def drive(engine: Any) -> Driven:
    return engine if isinstance(engine, Driven) else Driven(engine)
