"""Driving an ``EngineCore`` to completion in tests, with a deadline."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


def generate(
    engine: Any,
    prompts: Sequence[list[int]],
    params: Any,
    prefix: str = "r",
    timeout_s: float = 120,
) -> list[list[int]]:
    """Add every prompt as request ``{prefix}{i}``, step until all finish, and return their
    token ids in prompt order; a request that ends with an error fails the test."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, params)
    done: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "generation did not finish"
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"{prefix}{i}"] for i in range(len(prompts))]
