"""The Batch API against bad input and its own failures: lone surrogates in metadata and in
custom_ids, a line that cannot be recorded, a runner that dies (restarted; /health says so
when it cannot be), and temporary files left by a failed write."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx2 as httpx
import pytest

from pagedserve.serving.batch_api.store import BatchStore, RecordFile, write_json_atomic
from pagedserve.serving.openai.server import build_app

OK_BODY = {"prompt": "fine", "max_tokens": 2, "temperature": 0.0}
LONE = "\ud800"


@pytest.fixture(scope="module")
def client(llama_dir, srv) -> Iterator[Any]:
    c = srv.start_client(llama_dir, max_model_len=128)
    try:
        yield c
    finally:
        c.shutdown()


@pytest.fixture
def env(client, srv, tmp_path: Path) -> Iterator[SimpleNamespace]:
    app = build_app(client, batch_dir=tmp_path / "b", batch_max_in_flight=2)
    try:
        with srv.running(app) as url, httpx.Client(base_url=url, timeout=60) as http:
            yield SimpleNamespace(http=http, app=app, dir=tmp_path / "b", srv=srv)
    finally:
        app.state.batches.close()


def _upload(env, text: str) -> str:
    resp = env.http.post("/v1/files", data={"purpose": "batch"},
                         files={"file": ("in.jsonl", text.encode("ascii"))})
    assert resp.status_code == 200, resp.text
    return str(resp.json()["id"])


def _line(cid: str, body: dict[str, Any] = OK_BODY, method: str = "POST") -> str:
    # json.dumps escapes a lone surrogate as \ud800: the bytes on the wire are plain ASCII.
    return json.dumps({"custom_id": cid, "method": method, "url": "/v1/completions",
                       "body": body}) + "\n"


def _create(env, file_id: str, **extra: Any) -> httpx.Response:
    body = json.dumps({"input_file_id": file_id, "endpoint": "/v1/completions",
                       "completion_window": "24h", **extra})
    return env.http.post("/v1/batches", content=body.encode("ascii"),
                         headers={"content-type": "application/json"})


def _finished(env, batch_id: str, timeout: float = 120) -> dict[str, Any]:
    def done() -> bool:
        status = env.http.get(f"/v1/batches/{batch_id}").json().get("status")
        return status in ("completed", "failed", "cancelled")

    assert env.srv.wait_until(done, timeout), env.http.get(f"/v1/batches/{batch_id}").text
    return dict(env.http.get(f"/v1/batches/{batch_id}").json())


def _records(env, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = env.http.get(f"/v1/files/{file_id}/content").text
    return [json.loads(t) for t in text.splitlines()]


def _tmp_files(root: Path) -> list[Path]:
    return list(root.rglob("*.tmp"))


def test_lone_surrogate_in_metadata_is_refused_and_nothing_breaks(env) -> None:
    file_id = _upload(env, _line("a"))
    resp = _create(env, file_id, metadata={"k": LONE})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "metadata"
    resp = _create(env, file_id, metadata={LONE: "v"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "metadata"
    assert env.http.get("/v1/batches").status_code == 200
    good = _create(env, file_id, metadata={"k": "ünïcode ✓"})
    assert good.status_code == 200
    batch = _finished(env, good.json()["id"])
    assert batch["status"] == "completed" and batch["metadata"] == {"k": "ünïcode ✓"}
    assert env.http.get("/health").status_code == 200
    assert not _tmp_files(env.dir)


def test_lone_surrogate_custom_ids_round_trip_into_the_records(env, client, srv) -> None:
    text = (_line(LONE) + _line("\udfff", method="GET") + _line("plain")
            + _line("dup\udc00") + _line("dup\udc00"))
    batch = _finished(env, _create(env, _upload(env, text)).json()["id"])
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 5, "completed": 3, "failed": 2}
    out = {r["custom_id"]: r for r in _records(env, batch["output_file_id"])}
    assert sorted(out) == sorted([LONE, "plain", "dup\udc00"])
    assert out[LONE]["response"]["status_code"] == 200
    err = sorted((r["custom_id"], r["error"]["code"]) for r in
                 _records(env, batch["error_file_id"]))
    assert err == [("dup\udc00", "duplicate_custom_id"), ("\udfff", "invalid_method")]
    # The runner is alive: the next batch runs, and the list of batches answers.
    after = _finished(env, _create(env, _upload(env, _line("next"))).json()["id"])
    assert after["status"] == "completed"
    assert env.http.get("/v1/batches").status_code == 200
    assert not _tmp_files(env.dir)
    # A restart on the same directory reads the state back (nothing to redo, nothing lost).
    env.app.state.batches.close()
    again = BatchStore(env.dir)
    assert again.get_batch(batch["id"])["request_counts"] == batch["request_counts"]


def test_store_round_trips_any_string(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    src = store.upload_path()
    src.write_text(_line("a"))
    file_id = store.add_file(src, "in.jsonl", "batch")["id"]
    meta = {LONE: "x\udfff", "k": "ünï"}
    batch_id = store.create_batch(file_id, "/v1/completions", "24h", meta)["id"]
    assert BatchStore(tmp_path).get_batch(batch_id)["metadata"] == meta
    rf = RecordFile(tmp_path / "out.jsonl")
    rf.append({"id": "r", "custom_id": LONE, "response": None,
               "error": {"code": "c", "message": "ü" + LONE}})
    rf.close()
    assert RecordFile(tmp_path / "out.jsonl").keys == [(LONE, "c")]
    assert (tmp_path / "out.jsonl").read_bytes().decode("utf-8")  # still valid UTF-8
    assert not _tmp_files(tmp_path)


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        write_json_atomic(tmp_path / "x.json", {"not json": object()})
    assert not list(tmp_path.iterdir())
    stray = tmp_path / "batches" / ".b.json.0123.tmp"
    stray.parent.mkdir()
    stray.write_text("{")
    BatchStore(tmp_path)  # a start sweeps what a kill left
    assert not stray.exists()


def test_a_line_that_raises_is_an_error_record_and_the_batch_goes_on(env, monkeypatch) -> None:
    import pagedserve.serving.batch_api.runner as runner_mod

    real = runner_mod.answer_line

    async def flaky(ctx: Any, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("prompt") == "explode":
            raise RuntimeError("secret internals")
        return await real(ctx, endpoint, body)

    monkeypatch.setattr(runner_mod, "answer_line", flaky)
    deep = '{"custom_id": "deep", "body": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    text = _line("boom", {"prompt": "explode"}) + deep + _line("after")
    batch = _finished(env, _create(env, _upload(env, text)).json()["id"])
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    (ok,) = _records(env, batch["output_file_id"])
    assert ok["custom_id"] == "after"
    err = {r["custom_id"]: r for r in _records(env, batch["error_file_id"])}
    assert err["boom"]["error"]["code"] == "server_error"
    assert err["boom"]["response"]["status_code"] == 500
    assert "secret" not in json.dumps(err["boom"])  # the exception goes to the log only
    assert err[None]["error"]["code"] == "invalid_json"


def _dead_store(store: BatchStore, times: int | None) -> list[int]:
    """Make the runner's main loop raise on its next ``times`` scans (None: every one)."""
    real, calls = store.active_batches, [0]

    def broken() -> list[str]:
        calls[0] += 1
        if times is None or calls[0] <= times:
            raise RuntimeError("a bug in the loop")
        return real()

    store.active_batches = broken  # type: ignore[method-assign]
    return calls


def test_a_dead_runner_restarts_and_finishes_the_batch(client, srv, tmp_path: Path) -> None:
    from pagedserve.serving.batch_api.runner import BatchRunner

    app = build_app(client)
    store = BatchStore(tmp_path)
    src = store.upload_path()
    src.write_text(_line("a") + _line("b"))
    file_id = store.add_file(src, "in.jsonl", "batch")["id"]
    batch_id = store.create_batch(file_id, "/v1/completions", "24h", None)["id"]
    _dead_store(store, 2)
    runner = BatchRunner(store, app.state.context, restart_backoff_s=0.01, max_restarts=3)
    runner.start()
    try:
        assert srv.wait_until(lambda: store.get_batch(batch_id)["status"] == "completed", 60)
        assert runner.worker.restarts == 2 and runner.alive
        assert store.get_batch(batch_id)["request_counts"]["completed"] == 2
    finally:
        runner.close()


def test_a_runner_past_its_restarts_turns_health_503(client, srv, tmp_path: Path) -> None:
    import asyncio

    from pagedserve.serving.batch_api.runner import BatchRunner

    app = build_app(client)
    store = BatchStore(tmp_path)
    _dead_store(store, None)
    runner = BatchRunner(store, app.state.context, restart_backoff_s=0.01, max_restarts=2)
    app.state.batches = runner  # where build_app keeps its runner, for /health to ask
    runner.start()
    try:
        assert srv.wait_until(lambda: not runner.alive, 30)
        assert runner.worker.restarts == 2 and "RuntimeError" in (runner.worker.failure or "")

        async def health() -> int:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                return (await http.get("/health")).status_code

        assert asyncio.run(health()) == 503
    finally:
        runner.close()
