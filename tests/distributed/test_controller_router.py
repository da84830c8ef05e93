"""The data-parallel router's policy, over fake replicas (no Ray, no sockets)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
from helpers.sinks import add

from pagedserve.cluster.router import Router
from pagedserve.controller.errors import DuplicateRequestError, EngineDeadError, PromptTooLongError
from pagedserve.messages import CompletionDelta, RequestDelta, SamplingParams

B = 4


class FakeReplica:
    model_name = "m"
    max_model_len = 64
    vocab_size = 100
    block_size = B
    tokenizer = None
    error = None

    def __init__(self) -> None:
        self.sinks: dict[str, Any] = {}
        self.healthy = True
        self.aborted: list[str] = []

    def submit(self, request, sink) -> Future[None]:
        if len(request.prompt_token_ids) > self.max_model_len:
            raise PromptTooLongError("too long")
        self.sinks[request.request_id] = sink
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def finish(self, request_id: str) -> None:
        out = RequestDelta(request_id, [CompletionDelta(0, [1], "", None, "length")], True)
        self.sinks.pop(request_id)(out)

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> dict[str, Any]:
        return {"num_running": len(self.sinks)}

    def is_healthy(self) -> bool:
        return self.healthy

    def shutdown(self) -> None:
        pass


def _router(n: int = 3, **kw: Any) -> tuple[Router, list[FakeReplica]]:
    reps = [FakeReplica() for _ in range(n)]
    return Router(reps, block_size=B, **kw), reps


SP = SamplingParams()


def test_shared_prefix_is_sticky_and_short_prompts_balance() -> None:
    router, reps = _router()
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    for i in range(3):
        add(router, f"p{i}", prefix + [10 + i], SP, lambda out: None)
    where = {router.replica_of(f"p{i}") for i in range(3)}
    assert len(where) == 1
    # Only the first two blocks count: a different third block keeps the replica.
    add(router, "p-long", prefix + [9, 9, 9, 9, 1], SP, lambda out: None)
    assert router.replica_of("p-long") in where
    # No full block: least loaded, so these avoid the busy replica.
    for i in range(2):
        add(router, f"s{i}", [1, 2], SP, lambda out: None)
    assert all(router.replica_of(f"s{i}") not in where for i in range(2))
    # A salt changes the key (and the prefix cache would not share across salts anyway).
    assert router.prefix_key(prefix, None) != router.prefix_key(prefix, "tenant")
    assert [r for r in router.routes if r[0] == "p1"][0][2] == "prefix"


def test_overload_goes_to_least_loaded_and_finishing_releases_load() -> None:
    router, reps = _router(2, overload_factor=2.0, overload_slack=2)
    prefix = [5] * 8
    add(router, "a0", prefix, SP, lambda out: None)
    home = router.replica_of("a0")
    for i in range(1, 3):
        add(router, f"a{i}", prefix, SP, lambda out: None)
    assert {router.replica_of(f"a{i}") for i in range(3)} == {home}
    # Load 3 > 2 * 0 + 2: the next one goes elsewhere, and the prefix follows it.
    add(router, "a3", prefix, SP, lambda out: None)
    assert router.replica_of("a3") != home
    assert router.routes[-1][2] == "overload"
    stats = router.stats()
    assert [r["in_flight"] for r in stats["replicas"]] == ([3, 1] if home == 0 else [1, 3])
    for i in range(3):
        reps[home].finish(f"a{i}")
    assert router.stats()["replicas"][home]["in_flight"] == 0


def test_refusals_dead_replicas_and_abort() -> None:
    router, reps = _router(2)
    with pytest.raises(PromptTooLongError):
        add(router, "x", list(range(100)), SP, lambda out: None)
    assert router.replica_of("x") is None and sum(r["in_flight"] for r in
                                                  router.stats()["replicas"]) == 0
    add(router, "y", [1] * 8, SP, lambda out: None)
    with pytest.raises(DuplicateRequestError):
        add(router, "y", [1] * 8, SP, lambda out: None)
    home = router.replica_of("y")
    router.abort_request("y")
    assert reps[home].aborted == ["y"]
    reps[home].healthy = False
    add(router, "z", [1] * 8, SP, lambda out: None)
    assert router.replica_of("z") == 1 - home and router.is_healthy()
    reps[1 - home].healthy = False
    assert not router.is_healthy()
    with pytest.raises(EngineDeadError):
        add(router, "w", [1] * 8, SP, lambda out: None)
