"""Adding requests to an ``EngineClient`` the way tests like to read them back.

``add(client, id, prompt_ids, params, sink, prompt=..., cache_salt=...)`` builds the
``AddRequest`` and hands ``sink`` a snapshot of the request's cumulative ``RequestOutput`` after
every delta (built by the package's own ``OutputAccumulator``), so a test can compare outputs
over time. ``submit`` is the same without waiting for the verdict.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pagedserve.controller.outputs import OutputAccumulator
from pagedserve.messages import AddRequest, RequestDelta, RequestOutput, SamplingParams


def _request(request_id: str, prompt_token_ids: list[int], params: SamplingParams | None,
             prompt: str | None, cache_salt: str | None) -> AddRequest:
    return AddRequest(request_id, list(prompt_token_ids), params or SamplingParams(), prompt,
                      cache_salt)


def cumulative(req: AddRequest, sink: Callable[[RequestOutput], Any]) -> Callable[
        [RequestDelta], None]:
    acc = OutputAccumulator(req.request_id, req.prompt, list(req.prompt_token_ids), req.params.n)
    return lambda delta: sink(copy.deepcopy(acc.add(delta)))


def add(client: Any, request_id: str, prompt_token_ids: list[int],
        params: SamplingParams | None, sink: Callable[[RequestOutput], Any], *,
        prompt: str | None = None, cache_salt: str | None = None) -> None:
    req = _request(request_id, prompt_token_ids, params, prompt, cache_salt)
    client.add_request(req, cumulative(req, sink))


def submit(client: Any, request_id: str, prompt_token_ids: list[int],
           params: SamplingParams | None, sink: Callable[[RequestOutput], Any], *,
           prompt: str | None = None, cache_salt: str | None = None) -> Future[None]:
    req = _request(request_id, prompt_token_ids, params, prompt, cache_salt)
    return client.submit(req, cumulative(req, sink))
