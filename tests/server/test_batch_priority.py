"""Batch work runs behind interactive traffic.

The rule (``serving/batch_api/runner.py``): a batch line enters the engine only while fewer than
``max_in_flight`` batch lines are in it, no interactive call is in progress on the server, and
the engine reports no waiting request. A scripted engine checks each condition; the tiny
checkpoint checks the outcome: an interactive request sent while a big batch runs is answered
before the batch finishes, and at most one line (one decided just before it arrived) starts
while it runs.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx2 as httpx
import pytest

from pagedserve.messages import AddRequest, CompletionDelta, RequestDelta
from pagedserve.serving.batch_api.runner import BatchRunner
from pagedserve.serving.batch_api.store import BatchStore
from pagedserve.serving.openai.engine_run import ServerContext
from pagedserve.serving.openai.metrics import ServerMetrics
from pagedserve.serving.openai.server import build_app


class ScriptedEngine:
    """An ``EngineClient`` whose requests finish only when the test says so."""

    model_name = "scripted"
    max_model_len = 1024
    vocab_size = 100
    block_size = 16
    tokenizer = None
    error = None

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sinks: dict[str, Any] = {}
        self.added: list[str] = []
        self.waiting = 0

    def add_request(self, request: AddRequest, sink: Any) -> None:
        with self._lock:
            self.sinks[request.request_id] = sink
            self.added.append(request.request_id)

    def submit(self, request: AddRequest, sink: Any) -> Future[None]:
        self.add_request(request, sink)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def wait_added(self, fut: Future[None]) -> None:
        fut.result()

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self.sinks.pop(request_id, None)

    def stats(self) -> dict[str, Any]:
        return {"num_waiting": self.waiting, "num_running": len(self.sinks)}

    def is_healthy(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass

    def finish_all(self) -> int:
        with self._lock:
            sinks, self.sinks = self.sinks, {}
        for rid, sink in sinks.items():
            sink(RequestDelta(rid, [CompletionDelta(0, [7], "x", finish_reason="length")], True))
        return len(sinks)


def _input(store: BatchStore, n: int) -> str:
    src = store.upload_path()
    src.write_text("".join(
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": [1, 2, 3], "max_tokens": 1}}) + "\n" for i in range(n)))
    return store.add_file(src, "in.jsonl", "batch")["id"]


def test_each_condition_of_the_rule_holds_lines_back(tmp_path: Path, srv) -> None:
    engine = ScriptedEngine()
    ctx = ServerContext(engine, ServerMetrics(engine))  # type: ignore[arg-type]
    store = BatchStore(tmp_path)
    batch = store.create_batch(_input(store, 12), "/v1/completions", "24h", None)
    runner = BatchRunner(store, ctx, max_in_flight=3, poll_s=0.005)
    runner.start()

    def stays_held(added: int) -> None:
        """The runner looked at least 5 more times and still added nothing."""
        start = runner.held_back
        assert srv.wait_until(lambda: runner.held_back >= start + 5)
        assert len(engine.added) == added

    try:
        # 1. at most max_in_flight lines at once
        assert srv.wait_until(lambda: len(engine.sinks) == 3)
        stays_held(3)
        # 2. nothing new while an interactive call is in progress
        ctx.interactive.enter()
        assert engine.finish_all() == 3
        assert srv.wait_until(lambda: runner.in_flight == 0)
        stays_held(3)
        ctx.interactive.exit()  # wakes the runner
        assert srv.wait_until(lambda: len(engine.sinks) == 3)
        # 3. nothing new while the engine has waiting requests
        engine.waiting = 1
        engine.finish_all()
        assert srv.wait_until(lambda: runner.in_flight == 0)
        stays_held(6)
        engine.waiting = 0
        assert srv.wait_until(lambda: len(engine.sinks) == 3)
        # then the batch runs to its end
        while store.get_batch(batch["id"])["status"] != "completed":
            engine.finish_all()
            assert srv.wait_until(lambda: len(engine.sinks) > 0 or store.get_batch(
                batch["id"])["status"] == "completed")
        done = store.get_batch(batch["id"])
        assert done["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
        assert runner.submitted == 12 and len(engine.added) == 12
    finally:
        runner.close()


# ------------------------------------------------------------------ on the tiny checkpoint
@pytest.fixture
def live(llama_dir, srv, tmp_path: Path) -> Iterator[SimpleNamespace]:
    from openai import OpenAI

    client = srv.start_client(llama_dir, max_model_len=256)
    app = build_app(client, batch_dir=tmp_path / "batches", batch_max_in_flight=2)
    try:
        with srv.running(app) as url:
            oai = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
            yield SimpleNamespace(client=client, oai=oai, url=url, runner=app.state.batches,
                                  ctx=app.state.context, tmp=tmp_path)
            oai.close()
    finally:
        app.state.batches.close()
        client.shutdown()


def test_interactive_request_overtakes_a_running_batch(live, srv) -> None:
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"Batch line {i} about caches", "max_tokens": 12,
                       "temperature": 0.0, "ignore_eos": True}} for i in range(40)]
    path = live.tmp / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with open(path, "rb") as f:
        file = live.oai.files.create(file=f, purpose="batch")
    batch = live.oai.batches.create(input_file_id=file.id, endpoint="/v1/completions",
                                    completion_window="24h")
    assert srv.wait_until(
        lambda: live.oai.batches.retrieve(batch.id).request_counts.completed >= 2, timeout=120)
    # Count the lines started between the server's arrival and answer of the request.
    marks: dict[str, int] = {}
    traffic = live.ctx.interactive
    enter, leave = traffic.enter, traffic.exit

    def entered() -> None:
        enter()
        marks["enter"] = live.runner.submitted

    def left() -> None:
        marks["exit"] = live.runner.submitted
        leave()

    traffic.enter, traffic.exit = entered, left
    out = httpx.post(f"{live.url}/v1/completions", timeout=120, json={
        "prompt": "An interactive question", "max_tokens": 48, "temperature": 0.0,
        "ignore_eos": True})
    traffic.enter, traffic.exit = enter, leave
    started_meanwhile = marks["exit"] - marks["enter"]
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 48
    now = live.oai.batches.retrieve(batch.id)
    assert now.status == "in_progress" and now.request_counts.completed < 40
    # 48 decode steps would have let ~8 lines of 12 tokens start without the rule.
    assert started_meanwhile <= 1
    assert srv.wait_until(
        lambda: live.oai.batches.retrieve(batch.id).status == "completed", timeout=300)
    assert live.oai.batches.retrieve(batch.id).request_counts.completed == 40
