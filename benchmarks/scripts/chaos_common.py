"""What the server's reliability scripts share (``chaos.py``, ``fuzz_server.py``): a uvicorn
server in a thread, waiting for the server to be idle, a ``/health`` prober and percentiles."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import httpx2 as httpx
import uvicorn

from pagedserve.benchmarks.prom import parse_metrics

# docs/results/reliability.md's, where chaos.py and fuzz_server.py each keep a section
RESULTS_TITLE = "Reliability: chaos storms, hostile clients and fuzzing against the HTTP server"


def serve(app: Any, limits: Any = None) -> tuple[uvicorn.Server, threading.Thread, str]:
    """Serve ``app`` on a free port of 127.0.0.1 in a daemon thread; with ``limits`` (a
    ``ServerLimits``) configured as ``pagedserve serve`` configures uvicorn."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    if limits is None:
        config = uvicorn.Config(app, log_level="error", lifespan="off")
    else:
        from pagedserve.serving.openai.http_server import uvicorn_config

        config = uvicorn_config(app, limits, log_level="critical", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def _metrics(http: httpx.Client) -> dict[str, float]:
    """The server's unlabelled ``pagedserve_*`` samples, without the prefix."""
    prefix = "pagedserve_"
    return {name[len(prefix):]: value
            for (name, labels), value in parse_metrics(http.get("/metrics").text).samples.items()
            if not labels and name.startswith(prefix)}


def wait_idle(http: httpx.Client, *, fresh_check: bool = False) -> dict[str, float]:
    """``/metrics`` once nothing runs or waits and no KV block is in use (up to 60 s); with
    ``fresh_check``, also once the engine's KV integrity check has run since this call. The
    engine checks once per idle spell, and that spell may have begun before this call: one
    more request ends it, so that the next check is one after whatever came before."""
    checks = _metrics(http).get("kv_cache_integrity_checks_total", 0)
    if fresh_check:
        http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    deadline, idle = time.monotonic() + 60, {}
    while time.monotonic() < deadline:
        idle = _metrics(http)
        if (idle.get("num_requests_running") == 0 and idle.get("num_requests_waiting") == 0
                and idle.get("kv_cache_blocks_used") == 0
                and (not fresh_check or idle.get("kv_cache_integrity_checks_total", 0) > checks)):
            break
        time.sleep(0.05)
    return idle


def percentile(values: list[float], q: float) -> float:
    """The ``q`` (0..1) percentile by nearest rank; 0 for no values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class HealthProbe(threading.Thread):
    """GET /health every 20 ms on a connection of its own; each answer's latency, and when
    the slowest began (to find the requests in flight then)."""

    def __init__(self, url: str) -> None:
        super().__init__(name="health-probe", daemon=True)
        self.url, self.latencies, self.failures = url, list[float](), Counter[str]()
        self.slowest = (0.0, 0.0)  # (perf_counter at its start, seconds)
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as http:
            while not self.done.wait(0.02):
                t0 = time.perf_counter()
                try:
                    status: object = http.get("/health").status_code
                except httpx.TransportError as exc:
                    status = type(exc).__name__
                self.latencies.append(time.perf_counter() - t0)
                self.slowest = max(self.slowest, (t0, self.latencies[-1]), key=lambda x: x[1])
                if status != 200:
                    self.failures[str(status)] += 1

    def stop(self) -> dict[str, Any]:
        self.done.set()
        self.join(timeout=15)
        lat = self.latencies
        return {"probes": len(lat), "failures": dict(self.failures),
                "max_ms": max(lat, default=0.0) * 1e3, "p99_ms": percentile(lat, 0.99) * 1e3,
                "median_ms": percentile(lat, 0.5) * 1e3}


class ProbeProcess:
    """``HealthProbe`` in a process of its own: in the client's process its GIL holders (the
    garbage collector after hypothesis, building bodies, parsing answers: 200 ms pauses were
    measured) would delay the probe and be counted against the server. A plain subprocess of
    this file, not multiprocessing's spawn, which would import the caller's main module (torch
    and Ray for chaos.py) again. ``perf_counter`` is the system's monotonic clock, so
    ``slowest`` compares with the caller's times."""

    def __init__(self, url: str) -> None:
        self._cmd = [sys.executable, __file__, url]
        self.slowest = (0.0, 0.0)

    def start(self) -> None:
        self._proc = subprocess.Popen(self._cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True)
        assert self._proc.stdout is not None and self._proc.stdout.readline() == "ready\n"

    def stop(self) -> dict[str, Any]:
        out, _ = self._proc.communicate("stop\n", timeout=30)
        report = json.loads(out)
        self.slowest = tuple(report.pop("slowest"))
        return report


if __name__ == "__main__":  # the probe of ProbeProcess: ready, then its report at stop
    _probe = HealthProbe(sys.argv[1])
    _probe.start()
    while not _probe.latencies:  # probing before the caller goes on
        time.sleep(0.01)
    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps({**_probe.stop(), "slowest": _probe.slowest}), flush=True)
