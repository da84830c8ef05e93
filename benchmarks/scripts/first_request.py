"""Time to first token of the first requests after ``pagedserve serve`` reports ready.

Starts the server (its own process), waits for ``/health``, then sends requests one at a time,
alternating ``/v1/completions`` and ``/v1/chat/completions``, streamed, and reads each one's
first token off the wire. A server that leaves work for its first step shows it as a first
TTFT well above the median of the rest.

    python benchmarks/scripts/first_request.py [--model demo] [--backend local|ray] [--requests 10]
        [--starts 2] [--out FILE.md]

Each start is a fresh server process; the table gives, per start, the first request's TTFT,
the median of the others and their ratio.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Write one sentence about the sea, number {i}."


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, proc: subprocess.Popen, timeout_s: float = 600.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError("the server did not become ready")


def _model_name(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/v1/models")
    name = json.loads(conn.getresponse().read())["data"][0]["id"]
    conn.close()
    return name


def _ttft(port: int, model: str, i: int) -> float:
    """Seconds from sending request ``i`` to the first streamed token."""
    chat = i % 2 == 1
    text = PROMPT.format(i=i)
    body = {"model": model, "max_tokens": 4, "temperature": 0.0, "stream": True}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    path = "/v1/chat/completions" if chat else "/v1/completions"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    start = time.monotonic()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            piece = choice.get("text") or (choice.get("delta") or {}).get("content")
            # The first token's text, or the end when a random model's tokens decode to none.
            if (piece or choice.get("finish_reason")) and first is None:
                first = time.monotonic() - start
    conn.close()
    if first is None:
        raise RuntimeError(f"request {i} streamed no token")
    return first


def one_start(model: str, backend: str, requests: int) -> tuple[float, list[float]]:
    port = _free_port()
    cmd = [str(Path(sys.executable).with_name("pagedserve")), "serve", "--port", str(port),
           "--backend", backend, "--log-level", "warning"]
    if model != "default":
        cmd += ["--model", model]
    # From a scratch folder: the repo root would shadow installed packages with its own.
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            ready = _wait_ready(port, proc)
            name = _model_name(port)
            return ready, [_ttft(port, name, i) for i in range(requests)]
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--backend", default="ray", choices=["ray", "local"])
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--starts", type=int, default=2)
    p.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    args = p.parse_args(argv)
    rows = ["| start | ready (s) | first TTFT (ms) | median TTFT of the rest (ms) "
            "| first / median |", "|---|---|---|---|---|"]
    for s in range(args.starts):
        ready, ttfts = one_start(args.model, args.backend, args.requests)
        rest = statistics.median(ttfts[1:])
        rows.append(f"| {s + 1} | {ready:.1f} | {ttfts[0] * 1000:.0f} | {rest * 1000:.0f} "
                    f"| {ttfts[0] / rest:.2f} |")
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    print(table)
    if args.out is not None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).parent).stdout.strip()
        head = (f"`python benchmarks/scripts/first_request.py --model {args.model} --backend "
                f"{args.backend} --requests {args.requests} --starts {args.starts}` "
                f"(at {commit or 'unknown'})\n\n")
        args.out.write_text(head + table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
