"""The multi-host suite's driver: runs inside the head's namespace, attached to the cluster
with ``ray_address="auto"`` exactly as a user's script on the head would, and takes one JSON
command per stdin line, answering each with one JSON line on stdout (prefixed ``@@``, so Ray's
own prints on stdout cannot be mistaken for an answer).

One process serves the whole suite, so torch, Ray and the connection are paid for once.

Commands (``op``):
- ``generate``: start an ``LLM`` with ``options``, greedy-generate ``prompts``, shut it down;
  answers the token ids and, per replica, where each rank ran (rank, node id, node IP) and
  the IP of its controller.
- ``placement``: reserve a worker group's placement group (``strategy``, ``world_size``) and
  answer the rank table (``cluster.placement.rank_slots``) with each rank's node IP.
- ``start_long``: start an ``LLM`` and requests long enough to be running when the test acts;
  answers once every request has produced a token. ``finish_long``: wait for those requests to
  end and answer their errors and tokens; then ``generate`` again on the same engine
  (``again``).
- ``quit``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from typing import Any

import ray

from pagedserve import LLM, SamplingParams
from pagedserve.messages import AddRequest, RequestDelta


def _node_ips() -> dict[str, str]:
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}


def _wait_idle(timeout_s: float = 30.0) -> None:
    """Wait (bounded) until every CPU of the cluster is free again. Removing a placement group
    (an engine's shutdown, a finished job) frees its bundles asynchronously; a soft strategy
    (SPREAD, PACK) placed meanwhile settles for the nodes that are free, which is not what the
    test asks about."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        total = ray.cluster_resources().get("CPU", 0.0)
        if ray.available_resources().get("CPU", 0.0) >= total:
            return
        time.sleep(0.2)


def _replica_ranks(llm: LLM) -> list[dict[str, Any]]:
    client: Any = llm.client
    replicas = getattr(client, "replicas", None) or [client]
    infos = ray.get([r.actor.info.remote() for r in replicas], timeout=60)
    ips = _node_ips()
    return [{"ranks": info["ranks"], "controller_ip": ips.get(info["node_id"], "?")}
            for info in infos]


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


class Driver:
    def __init__(self, checkpoint: str) -> None:
        self.checkpoint = checkpoint
        self.llm: LLM | None = None
        self.long_done: threading.Event = threading.Event()
        self.long_errors: dict[str, str | None] = {}
        self.long_tokens: dict[str, list[int]] = {}

    def _llm(self, options: dict[str, Any]) -> LLM:
        base = {"model": self.checkpoint, "dtype": "float32", "block_size": 4,
                "kv_cache_memory_bytes": 1 << 22, "max_num_batched_tokens": 64,
                "max_num_seqs": 8}
        return LLM(ray_address="auto", backend="ray", **{**base, **options})

    def op_generate(self, options: dict[str, Any], prompts: list[list[int]],
                    max_tokens: int) -> dict[str, Any]:
        llm = self._llm(options)
        try:
            tokens = _greedy(llm, prompts, max_tokens)
            return {"tokens": tokens, "replicas": _replica_ranks(llm)}
        finally:
            llm.shutdown()

    def op_placement(self, strategy: str, world_size: int) -> dict[str, Any]:
        from pagedserve.cluster.placement import (
            rank_slots,
            remove_quietly,
            reserve_worker_group,
        )

        pg = reserve_worker_group(world_size, strategy, timeout_s=30.0)
        try:
            slots = rank_slots(pg, ray.get_runtime_context().get_node_id())
            ips = _node_ips()
            return {"ranks": [{"rank": s.rank, "bundle": s.bundle_index, "node_id": s.node_id,
                               "node_ip": ips.get(s.node_id, "?")} for s in slots]}
        finally:
            remove_quietly(pg)

    def op_start_long(self, options: dict[str, Any], prompts: list[list[int]],
                      max_tokens: int) -> dict[str, Any]:
        self.llm = llm = self._llm(options)
        started = {f"long-{i}": threading.Event() for i in range(len(prompts))}
        self.long_errors = {}
        self.long_tokens = {rid: [] for rid in started}
        self.long_done = threading.Event()
        lock = threading.Lock()

        def sink(delta: RequestDelta) -> None:
            for c in delta.completions:
                self.long_tokens[delta.request_id] += c.token_ids
            if any(c.token_ids for c in delta.completions):
                started[delta.request_id].set()
            if delta.finished or delta.error is not None:
                started[delta.request_id].set()
                with lock:
                    self.long_errors[delta.request_id] = delta.error
                    if len(self.long_errors) == len(started):
                        self.long_done.set()

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        assert llm.client is not None
        for (rid, _), prompt in zip(started.items(), prompts, strict=True):
            llm.client.add_request(AddRequest(rid, prompt, params), sink)
        for event in started.values():
            if not event.wait(120):
                raise TimeoutError("a long request produced no token within 120 s")
        return {"replicas": _replica_ranks(llm), "finished_early": dict(self.long_errors)}

    def op_finish_long(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        assert self.llm is not None
        llm, self.llm = self.llm, None
        try:
            if not self.long_done.wait(180):
                raise TimeoutError("the long requests neither finished nor failed in 180 s")
            answer: dict[str, Any] = {"errors": dict(self.long_errors),
                                      "tokens": dict(self.long_tokens)}
            try:
                answer["again"] = _greedy(llm, prompts, max_tokens)
                answer["replicas"] = _replica_ranks(llm)
            except Exception as exc:  # the engine may report that it cannot serve again
                answer["again_error"] = f"{type(exc).__name__}: {exc}"
            return answer
        finally:
            llm.shutdown()


def main() -> int:
    ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
    driver = Driver(sys.argv[1])
    print("@@" + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            break
        try:
            _wait_idle()
            answer = getattr(driver, f"op_{op}")(**cmd)
        except Exception as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        print("@@" + json.dumps(answer), flush=True)
    if driver.llm is not None:
        driver.llm.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
