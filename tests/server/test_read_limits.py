"""Reading a request is bounded (#27 rows 3 and 10): headers and body must arrive within their
timeouts, and a body over the size limit is refused while it is read, never buffered whole.

Each case talks to a real uvicorn server over a raw socket and waits on the server's answer
(its 408/413 and the end of the connection) with a generous deadline, never on a sleep."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx2 as httpx
import pytest
from helpers.live_server import live_server

from pagedserve.serving.openai.limits import ServerLimits
from pagedserve.serving.openai.server import build_app

LIMITS = ServerLimits(header_timeout_s=0.5, body_timeout_s=0.5, max_body_bytes=1 << 20)
# What "closed in time" allows on a loaded machine: the timeouts are 0.5 s.
DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def env(llama_dir, srv) -> Iterator[SimpleNamespace]:
    client = srv.start_client(llama_dir)
    try:
        with live_server(build_app(client, limits=LIMITS), LIMITS) as url:
            yield SimpleNamespace(url=url, port=int(url.rsplit(":", 1)[1]))
    finally:
        client.shutdown()


def _connect(env) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", env.port), timeout=DEADLINE_S)
    return sock


def _read_to_close(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed
    (``socket.timeout`` if it keeps the connection past the deadline)."""
    chunks = []
    while True:
        data = sock.recv(65536)
        if not data:
            return b"".join(chunks), time.monotonic()
        chunks.append(data)


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def _json_body(raw: bytes) -> dict:
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


def test_headers_that_never_finish_get_408_and_a_closed_connection(env) -> None:
    with _connect(env) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: app")
        start = time.monotonic()
        raw, closed = _read_to_close(sock)
    assert _status(raw) == 408 and b"headers" in raw
    assert closed - start >= LIMITS.header_timeout_s * 0.9  # not before its time


def test_a_silent_connection_is_closed(env) -> None:
    with _connect(env) as sock:
        raw, _ = _read_to_close(sock)
    assert _status(raw) == 408


def test_a_slow_body_gets_408(env) -> None:
    with _connect(env) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro")
        raw, _ = _read_to_close(sock)
    assert _status(raw) == 408
    body = _json_body(raw)
    assert "did not arrive within 0.5 s" in body["error"]["message"]
    assert "--body-timeout" in body["error"]["message"]


def test_a_declared_oversize_body_is_refused_unread(env) -> None:
    """#27: a 300 MB JSON body was accepted. Now Content-Length alone earns the 413 (here
    once the body timeout passes: the client sends nothing of it)."""
    with _connect(env) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 300000000\r\n\r\n")
        raw, _ = _read_to_close(sock)
    assert _status(raw) == 413
    assert _json_body(raw)["error"]["code"] == "request_too_large"


def test_a_chunked_oversize_body_is_refused_while_it_is_read(env) -> None:
    """No Content-Length: refused once the bytes read pass the limit (1 MiB); the rest is
    dropped as it comes."""
    answer: list[bytes] = []
    with _connect(env) as sock:
        # Read while sending: the answer arrives mid-upload, before the connection is closed.
        reader = threading.Thread(target=lambda: answer.append(_read_answer(sock)))
        reader.start()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        try:
            for _ in range(64):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sock.sendall(b"0\r\n\r\n")
        except OSError:  # the server closed its end: the upload is cut short
            pass
        reader.join(DEADLINE_S)
    assert answer and _status(answer[0]) == 413
    assert _json_body(answer[0])["error"]["code"] == "request_too_large"


def _read_answer(sock: socket.socket) -> bytes:
    """The first response's bytes (up to the end of its body)."""
    raw = b""
    while b"\r\n\r\n" not in raw or len(raw.split(b"\r\n\r\n", 1)[1]) < _length(raw):
        data = sock.recv(65536)
        if not data:
            break
        raw += data
    return raw


def _length(raw: bytes) -> int:
    for line in raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_a_client_that_sends_too_much_reads_a_clean_413(env) -> None:
    with httpx.Client(base_url=env.url, timeout=30) as http:
        out = http.post("/v1/completions", json={"prompt": "x" * (2 << 20), "max_tokens": 1})
    assert out.status_code == 413
    assert "--max-body-bytes" in out.json()["error"]["message"]


def test_ordinary_requests_are_untouched(env) -> None:
    with httpx.Client(base_url=env.url, timeout=30) as http:
        for _ in range(2):  # the second on the kept-alive connection
            out = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
            assert out.status_code == 200, out.text
        assert http.get("/health").status_code == 200
