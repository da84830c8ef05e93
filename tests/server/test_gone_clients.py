"""Gone clients are noticed (#27 rows 4 and 5).

* A non-streamed request whose client disconnects is aborted within 1 s while its output keeps
  arriving (the old wait looked for a disconnect only after 1 s without output, so a request
  producing tokens ran to its end: KV 144 -> 984 blocks).
* A stream whose client stays connected but reads nothing is aborted after the write timeout
  and its unsent output dropped (16 such streams held 500 MB and counted as in flight, which
  starves the Batch API).
"""

from __future__ import annotations

import gc
import json
import re
import socket
import time
from collections.abc import Iterator

import httpx2 as httpx
import pytest
from helpers.live_server import live_server

from pagedserve.serving.openai.engine_run import EngineRun
from pagedserve.serving.openai.limits import ServerLimits
from pagedserve.serving.openai.server import build_app


@pytest.fixture(scope="module")
def client(llama_dir, srv) -> Iterator[object]:
    c = srv.start_client(llama_dir, enable_prefix_caching=False, max_model_len=512,
                         kv_cache_memory_bytes=1 << 24)
    try:
        yield c
    finally:
        c.shutdown()


def _idle(client) -> bool:
    s = client.stats()
    return s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_blocks_used"] == 0


def _aborted(http: httpx.Client) -> float:
    m = re.search(r'^pagedserve_request_success_total\{finished_reason="abort"\} (\S+)$',
                  http.get("/metrics").text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def _post(
    port: int, path: str, body: dict, rcvbuf: int | None = None, key: str | None = None
) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # before connecting, so the window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    auth = b"Authorization: Bearer %s\r\n" % key.encode() if key else b""
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s"
                 b"Content-Length: %d\r\n\r\n%s" % (path.encode(), auth, len(data), data))
    return sock


def test_a_gone_client_is_aborted_while_output_keeps_arriving(client, srv) -> None:
    n = 16
    body = {"prompt": "A paged cache splits the memory", "max_tokens": 450, "n": n,
            "logprobs": 5, "temperature": 0.0, "ignore_eos": True}
    with srv.running(build_app(client)) as url, httpx.Client(base_url=url, timeout=30) as http:
        before = _aborted(http)
        port = int(url.rsplit(":", 1)[1])
        sock = _post(port, "/v1/completions", body)
        # Output is arriving: the sequences run (and produce a token per step).
        assert srv.wait_until(lambda: client.stats()["num_running"] >= n, timeout=30)
        sock.close()
        gone = time.monotonic()
        assert srv.wait_until(lambda: _idle(client), timeout=30)
        freed = time.monotonic() - gone
        # Cut short, not run to its end: every completion ended by abort, within 1 s.
        assert _aborted(http) == before + n
        assert freed < 1.0, f"aborted {freed:.2f} s after the client left"


STALL = ServerLimits(write_timeout_s=0.5)


@pytest.mark.parametrize("key", [None, "k"], ids=["open", "api-key"])
def test_streams_nobody_reads_are_aborted_and_dropped(client, srv, key) -> None:
    """With an API key the stream is relayed through the key check's own task: the write
    timeout holds there too."""
    app = build_app(client, limits=STALL, api_key=key)
    body = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 300,
            "n": 4, "logprobs": True, "top_logprobs": 20, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    with live_server(app, STALL, sndbuf=4096) as url:
        port = int(url.rsplit(":", 1)[1])
        socks = [_post(port, "/v1/chat/completions", body, rcvbuf=4096, key=key)
                 for _ in range(4)]
        try:
            ctx = app.state.context
            assert srv.wait_until(lambda: ctx.interactive.count == 4, timeout=30)
            # Nobody reads: each stream's writes stall, and the write timeout ends it.
            assert srv.wait_until(lambda: ctx.interactive.count == 0, timeout=30), (
                f"{ctx.interactive.count} streams still in flight")
            assert srv.wait_until(lambda: _idle(client), timeout=30)
            for sock in socks:  # the server closed each stream before its end
                sock.settimeout(30)
                received = b""
                while chunk := sock.recv(1 << 16):
                    received += chunk
                assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
        finally:
            for sock in socks:
                sock.close()
    gc.collect()
    # Nothing of the four runs is kept: not their output, not the runs themselves.
    left = [r for r in gc.get_objects() if type(r) is EngineRun and r.params.max_tokens == 300]
    assert not left, [len(s.pending) for r in left for s in r.subs]


def test_a_stream_that_is_read_is_untouched_by_the_write_timeout(client) -> None:
    app = build_app(client, limits=STALL)
    body = {"prompt": "Hello", "max_tokens": 64, "ignore_eos": True, "stream": True,
            "logprobs": 5}
    with live_server(app, STALL) as url, httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
