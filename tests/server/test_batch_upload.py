"""``POST /v1/files`` streams its body into ``--batch-dir``: the file grows there while the body
arrives, a body past the limit is refused as soon as the limit is passed (not after the whole
body was read), and nothing of it is left behind."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx2 as httpx
import pytest

import pagedserve.serving.batch_api.routes as routes
from pagedserve.serving.openai.server import build_app

BOUNDARY = "upload-boundary-7f3a"
CHUNK = 64 << 10
LIMIT = 4 << 20


@pytest.fixture(scope="module")
def client(llama_dir, srv) -> Iterator[object]:
    c = srv.start_client(llama_dir, max_model_len=128)
    try:
        yield c
    finally:
        c.shutdown()


@pytest.fixture
def env(client, srv, tmp_path: Path, monkeypatch) -> Iterator[SimpleNamespace]:
    monkeypatch.setattr(routes, "MAX_UPLOAD_BYTES", LIMIT)
    app = build_app(client, batch_dir=tmp_path / "b")
    try:
        with srv.running(app) as url, httpx.Client(base_url=url, timeout=60) as http:
            yield SimpleNamespace(http=http, files=tmp_path / "b" / "files")
    finally:
        app.state.batches.close()


def _head(purpose: str = "batch") -> bytes:
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
            f"{purpose}\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"big.jsonl\"\r\nContent-Type: application/octet-stream\r\n\r\n").encode()


TAIL = f"\r\n--{BOUNDARY}--\r\n".encode()
HEADERS = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}


def _partial_uploads(files: Path) -> list[Path]:
    return list(files.glob(".upload-*.tmp")) if files.exists() else []


def _wait(cond, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_an_oversized_upload_is_refused_while_it_streams(env) -> None:
    seen: dict[str, bool] = {}

    def body() -> Iterator[bytes]:
        yield _head()
        line = b'{"custom_id": "x", "method": "POST", "url": "/v1/completions"}\n'
        chunk = (line * (CHUNK // len(line) + 1))[:CHUNK]
        for _ in range(LIMIT // 2 // CHUNK):
            yield chunk
        # Half the limit is sent: the file must be growing in --batch-dir already.
        seen["on_disk"] = _wait(lambda: any(
            p.stat().st_size > 0 for p in _partial_uploads(env.files)))
        for _ in range(LIMIT // 2 // CHUNK + 4):
            yield chunk
        # Just past the limit: the server refuses now and deletes the partial file, with
        # most of the body (another 7 limits' worth) still unsent.
        seen["refused"] = seen["on_disk"] and _wait(lambda: not _partial_uploads(env.files))
        if not seen["refused"]:
            for _ in range(7 * LIMIT // CHUNK):
                yield chunk
            yield TAIL

    try:
        resp = env.http.post("/v1/files", content=body(), headers=HEADERS)
        status, error = resp.status_code, resp.json()["error"]
    except httpx.TransportError:  # the server may close before the client reads the 413
        status, error = 413, {"code": "file_too_large"}
    assert seen["on_disk"], "the body was not streamed into --batch-dir"
    assert seen["refused"], "the server read on past the limit"
    assert status == 413 and error["code"] == "file_too_large"
    assert not _partial_uploads(env.files)
    assert env.http.get("/v1/files").json()["data"] == []


def test_a_declared_oversized_body_is_refused_before_reading(env) -> None:
    host, port = env.http.base_url.host, env.http.base_url.port
    with socket.create_connection((host, port), timeout=20) as sock:
        sock.sendall(f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                     f"{HEADERS['content-type']}\r\nContent-Length: {2 * LIMIT}\r\n"
                     "Expect: 100-continue\r\n\r\n".encode())
        # The client waits for leave to send its body (as curl does for large uploads): the answer
        # must come without it.
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert not _partial_uploads(env.files)


def test_uploads_at_the_limit_and_bad_forms(env) -> None:
    data = b"y" * LIMIT
    ok = env.http.post("/v1/files", content=_head() + data + TAIL, headers=HEADERS)
    assert ok.status_code == 200, ok.text
    meta = ok.json()
    assert meta["bytes"] == LIMIT and meta["filename"] == "big.jsonl"
    assert env.http.get(f"/v1/files/{meta['id']}/content").content == data
    over = env.http.post("/v1/files", content=_head() + data + b"y" + TAIL, headers=HEADERS)
    assert over.status_code == 413
    cases = [
        (_head("fine-tune") + b"{}\n" + TAIL, HEADERS, "purpose"),
        (_head() + b"{}\n", HEADERS, "file"),  # no closing boundary
        (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch"
         f"\r\n--{BOUNDARY}--\r\n".encode(), HEADERS, "file"),  # no file part
        (b"purpose=batch", {"content-type": "application/x-www-form-urlencoded"}, "file"),
    ]
    for content, headers, param in cases:
        resp = env.http.post("/v1/files", content=content, headers=headers)
        assert resp.status_code == 400, (content[:60], resp.text)
        assert resp.json()["error"]["param"] == param
    assert not _partial_uploads(env.files)
    assert [f["id"] for f in env.http.get("/v1/files").json()["data"]] == [meta["id"]]
