"""The in-process and the Ray backends run the same engine loop: one scripted sequence (adds, a
refusal, an abort, preemptions, ``n > 1``, a worker failure in the middle of decoding and the
recovery after it) gives the same deltas and the same errors through both. The failure costs
no request: they resume on the rebuilt group with the tokens of an uninterrupted run."""

from __future__ import annotations

import queue
import time
from typing import Any

import helpers.fake_executor as fake_executor
import helpers.scripted as scripted
import pytest
import ray

from pagedserve.builder import model_name
from pagedserve.cluster.launch import start_controllers
from pagedserve.config import from_flat
from pagedserve.controller.client import LocalEngineClient
from pagedserve.controller.errors import PromptTooLongError
from pagedserve.controller.loop import EngineLoop
from pagedserve.messages import AddRequest, RequestDelta, SamplingParams

# One decode pass per step: how many a step runs follows from whether a request waits when it
# is scheduled, which the moment each add lands decides, so the deltas' grouping would too.
CONFIG = from_flat(block_size=4, num_gpu_blocks=24, max_model_len=96, max_num_seqs=4,
                   max_num_batched_tokens=32, num_scheduler_steps=1)
LONG = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
SIDE = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _script(client: Any) -> tuple[dict[str, list[tuple]], list[str], dict[str, Any]]:
    """Run the sequence; returns each request's deltas (as tuples), the errors, the stats."""
    deltas: dict[str, list[tuple]] = {}
    finished: queue.SimpleQueue[str] = queue.SimpleQueue()
    errors: list[str] = []

    def sink(d: RequestDelta) -> None:
        deltas.setdefault(d.request_id, []).append((
            d.finished, d.error is not None,
            [(c.index, tuple(c.token_ids), c.finish_reason) for c in d.completions],
        ))
        if d.finished:
            finished.put(d.request_id)

    def wait(ids: set[str]) -> None:
        deadline = time.monotonic() + 60
        while ids:
            ids.discard(finished.get(timeout=max(0.1, deadline - time.monotonic())))

    # Phase 1: more work than the KV pool holds at once (so the scheduler preempts), n > 1,
    # a refusal, and an abort of a request still waiting behind max_num_seqs.
    phase1 = [AddRequest(f"long{i}", [10 + i] * 8, LONG) for i in range(4)]
    phase1.append(AddRequest("pair", [3, 4, 5], SamplingParams(n=2, max_tokens=6,
                                                               ignore_eos=True)))
    phase1.append(AddRequest("queued", [7] * 5, LONG))
    futs = [client.submit(r, sink) for r in phase1]
    for f in futs:
        client.wait_added(f)
    client.abort_request("queued")
    try:
        client.add_request(AddRequest("too-long", [1] * 200, LONG), sink)
    except PromptTooLongError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    wait({r.request_id for r in phase1})
    stats = client.stats()  # the failure below resets the scheduler's counters
    # Phase 2: the worker group fails while three requests decode (when "victim" is about to
    # sample its fourth token); the engine rebuilds it and they carry on.
    phase2 = [AddRequest("victim", [1, 2, 3, 4], LONG)]
    phase2 += [AddRequest(f"side{i}", [20 + i] * 3, SIDE) for i in range(2)]
    futs = [client.submit(r, sink) for r in phase2]
    for f in futs:
        client.wait_added(f)
    wait({r.request_id for r in phase2})
    stats["num_worker_restarts"] = client.stats()["num_worker_restarts"]
    # Phase 3: served again after the recovery.
    client.add_request(AddRequest("after", [9, 9], SamplingParams(max_tokens=5,
                                                                 ignore_eos=True)), sink)
    wait({"after"})
    return deltas, errors, stats


def _check(deltas: dict[str, list[tuple]], errors: list[str], stats: dict[str, Any]) -> None:
    assert errors and errors[0].startswith("PromptTooLongError")
    assert deltas["queued"] == [(True, False, [(0, (), "abort")])]
    assert stats["num_worker_restarts"] == 1  # the failure happened, and cost nothing:
    assert not [rid for rid, ds in deltas.items() for d in ds if d[1]]  # no error delta
    for rid, last, n in (("victim", 4, 30), ("side0", 20, 12), ("side1", 21, 12)):
        tokens = [t for d in deltas[rid] for c in d[2] for t in c[1]]
        assert tokens == scripted.greedy_after(last, n)
        assert deltas[rid][-1][0] and deltas[rid][-1][2][-1][2] == "length"
    assert [c for d in deltas["after"] for c in d[2]][-1][2] == "length"
    assert len(deltas["pair"][-1][2]) >= 1 and stats["num_preemptions"] > 0
    for i in range(4):
        toks = [t for d in deltas[f"long{i}"] for c in d[2] for t in c[1]]
        assert toks == scripted.greedy_after(10 + i, 30)


def test_the_backends_give_the_same_deltas_and_errors(ray_local) -> None:
    local = LocalEngineClient(EngineLoop(scripted.build_scripted_engine(CONFIG)), "scripted")
    try:
        local_run = _script(local)
    finally:
        local.shutdown()
    _check(*local_run)

    ray.cloudpickle.register_pickle_by_value(fake_executor)
    ray.cloudpickle.register_pickle_by_value(scripted)
    try:
        remote = start_controllers(CONFIG, scripted.build_scripted_engine,
                                   model_name=model_name(CONFIG), reserve_workers=False)
        try:
            ray_run = _script(remote)
        finally:
            remote.shutdown()
    finally:
        ray.cloudpickle.unregister_pickle_by_value(scripted)
        ray.cloudpickle.unregister_pickle_by_value(fake_executor)
    _check(*ray_run)
    assert ray_run[0] == local_run[0]
    assert ray_run[1] == local_run[1]
    assert ray_run[2]["num_preemptions"] > 0
    for key in ("kv_blocks_used", "num_running", "num_waiting"):
        assert ray_run[2][key] == local_run[2][key], key


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
