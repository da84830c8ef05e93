"""The event loop never blocks (#27 row 3): while a server refuses a 20 MB prompt, 16 x 2 MB
``/tokenize`` and an answer of millions of logprobs, and while it tokenizes 16 long prompts
for real, ``/health`` answers within 100 ms.

The server is a real ``pagedserve serve`` process (so the probes measure its event loop, not
this process's GIL). Each probe's latency is taken only while heavy requests are provably in
flight (sent, not yet answered), and the bound is on the worst of them.

The bound holds by a wide margin on an idle machine (worst probe about 20 ms) and with a load
of 3-5 on two cores (up to about 70 ms). Past that, the OS alone can hold any thread off a
core for 100 ms, so a scenario gets three tries and must stay under the bound in one: on the
old code every try stalls for hundreds of milliseconds, as tokenizing on the loop stalls it
every time, and a real regression (work back on the loop) fails all three the same way.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx2 as httpx
import pytest

RUNNER = (
    "import argparse, sys\n"
    "from pagedserve.serving.cli.serve import add_serve_parser, run_serve\n"
    "p = argparse.ArgumentParser(); sub = p.add_subparsers(dest='command')\n"
    "add_serve_parser(sub)\n"
    "sys.exit(run_serve(p.parse_args(sys.argv[1:])))\n"
)
HEALTH_BOUND_S = 0.100
TRIES = 3
# 128 KB prompts are tokenized (about 0.25 s each with the test tokenizer); 2 MB ones are not.
MAX_PROMPT_CHARS = 200_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(llama_dir) -> Iterator[SimpleNamespace]:
    port = _free_port()
    cmd = [
        sys.executable, "-c", RUNNER, "serve", "--model", str(llama_dir), "--port", str(port),
        "--max-model-len", "256", "--kv-cache-memory-bytes", str(1 << 22), "--backend",
        "local", "--log-level", "warning", "--max-prompt-chars", str(MAX_PROMPT_CHARS),
    ]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield SimpleNamespace(url=url)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()


def _probe_while(url: str, heavy: list[tuple[str, dict]]) -> tuple[list, list[float]]:
    """Send the heavy requests at once (each from its own thread, its JSON encoded before,
    so that this process is idle but for the sockets), probe /health until the last one is
    answered; returns their responses and the latencies of the probes made while one was in
    flight."""
    bodies = [(path, json.dumps(body).encode()) for path, body in heavy]
    lock = threading.Lock()
    in_flight = 0
    started = threading.Barrier(len(bodies) + 1)

    def one(path: str, body: bytes) -> httpx.Response:
        nonlocal in_flight
        with httpx.Client(base_url=url, timeout=120) as http:
            started.wait()
            with lock:
                in_flight += 1
            try:
                return http.post(path, content=body,
                                 headers={"content-type": "application/json"})
            finally:
                with lock:
                    in_flight -= 1

    latencies: list[float] = []
    with httpx.Client(base_url=url, timeout=30) as probe, \
         ThreadPoolExecutor(len(bodies)) as pool:
        assert probe.get("/health").status_code == 200  # a warm connection
        futures = [pool.submit(one, path, body) for path, body in bodies]
        started.wait()
        deadline = time.monotonic() + 60
        while not all(f.done() for f in futures) and time.monotonic() < deadline:
            busy = in_flight > 0
            start = time.perf_counter()
            assert probe.get("/health").status_code == 200
            if busy and in_flight > 0:  # in flight from before the probe to after it
                latencies.append(time.perf_counter() - start)
            time.sleep(0.01)
        return [f.result() for f in futures], latencies


def _within_bound(
    url: str, heavy: list[tuple[str, dict]], min_probes: int = 1
) -> list[httpx.Response]:
    """The answers of the first try whose every probe stayed under the bound (see above);
    each try must have made ``min_probes`` probes while the heavy requests were in flight."""
    worst = []
    for _ in range(TRIES):
        answers, latencies = _probe_while(url, heavy)
        if max(latencies, default=0.0) < HEALTH_BOUND_S:
            assert len(latencies) >= min_probes, f"too few probes in flight: {latencies}"
            return answers
        worst.append(sorted(latencies)[-3:])
    raise AssertionError(f"/health took over {HEALTH_BOUND_S} s in every try: {worst}")


def test_health_stays_fast_while_huge_requests_are_refused(server) -> None:
    """Refusing must be cheap: a 20 MB body (413 from its length), 2 MB prompts (400 before
    tokenizing; #27: 16 x 2 MB /tokenize stalled everything for seconds) and an echo answer of
    millions of logprobs (400 before the engine sees it)."""
    big = "lorem ipsum dolor sit amet " * 80_000  # 2.2 MB
    heavy = [("/tokenize", {"prompt": big}) for _ in range(16)]
    heavy.append(("/v1/completions", {"prompt": big * 9, "max_tokens": 1}))
    heavy.append(("/v1/completions", {"prompt": big, "max_tokens": 1}))
    heavy.append(("/v1/completions", {
        "prompt": list(range(3, 253)), "echo": True, "logprobs": 20, "max_tokens": 0,
        "n": 128}))
    answers = _within_bound(server.url, heavy)
    assert [a.status_code for a in answers] == [400] * 16 + [413, 400, 400], [
        a.text[:200] for a in answers]
    assert all(a.json()["error"]["code"] == "request_too_large" for a in answers)


def test_health_stays_fast_while_long_prompts_are_tokenized(server) -> None:
    """16 prompts of 128 KB tokenized for real (about a second of work), off the event loop."""
    texts = [f"{i} the quick brown fox jumps over the lazy dog " * 2900 for i in range(16)]
    heavy = [("/tokenize", {"prompt": t}) for t in texts]
    answers = _within_bound(server.url, heavy, min_probes=5)
    assert all(a.status_code == 200 for a in answers), [a.text[:200] for a in answers]
    assert all(a.json()["count"] > 10_000 for a in answers)
