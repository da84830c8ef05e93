"""``pagedserve bench serving``: a request-rate sweep against the HTTP server.

Either against a server that is already running (``--url``), or against one ``pagedserve
serve`` subprocess per allocation policy that this command starts (the default: the Ray
controller and workers, the demo checkpoint, a small KV pool so that ``reserve`` is memory
bound), each reused across the rates.

Per rate: N requests with Gamma (Poisson at burstiness 1) arrivals, token-id prompts with
synthetic lengths, ``max_tokens`` = the sampled output length with ``ignore_eos`` (every
request produces exactly that many tokens), streamed from ``/v1/completions``. The client
times every server-sent event the way ``vllm bench serve`` does, so the numbers can be
cross-checked with that tool (or GuideLLM) against the same server:

* TTFT: send -> first event carrying a choice; ITL: gaps between such events;
* E2E latency: send -> end of the stream; TPOT: (E2E - TTFT) / (output tokens - 1);
* normalised latency (the vLLM paper's): E2E / output tokens, averaged over requests;
* output tokens from the final ``usage`` chunk (``stream_options.include_usage``).

From ``/metrics``, scraped before and after each rate: preemptions and the histogram of
tokens batched per engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pagedserve.benchmarks.prom import parse_metrics
from pagedserve.benchmarks.report import command_line, write_json
from pagedserve.benchmarks.serving_report import render, replot, targets
from pagedserve.benchmarks.serving_stats import (
    RequestResult,
    capacity,
    meets,
    summarise,
)
from pagedserve.benchmarks.workloads import WORKLOADS, arrival_times, sample_lengths

__all__ = [
    "RequestResult",
    "ServingOptions",
    "capacity",
    "render",
    "replot",
    "run_serving",
    "running_server",
    "server_command",
]


@dataclass
class ServingOptions:
    out: Path
    url: str | None = None
    """A running server; None starts one ``pagedserve serve`` per policy."""
    label: str = "server"
    """Name of the ``--url`` server in the results."""
    policies: tuple[str, ...] = ("paged", "reserve")
    rates: tuple[float, ...] = (0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0)
    duration_s: float | None = 40.0
    """Arrivals span this long at every rate: ``rate * duration_s`` requests (at least
    ``min_requests``), a fixed-length trace as in the paper. None: ``num_requests`` each."""
    min_requests: int = 30
    num_requests: int = 50
    """Requests per rate when ``duration_s`` is None."""
    workload: str = "sharegpt-vllm"
    burstiness: float = 1.0
    max_model_len: int = 2048
    num_gpu_blocks: int = 257
    """KV pool of the servers this command starts (null block included)."""
    backend: str = "ray"
    server_args: str = ""
    """More ``pagedserve serve`` options for the servers this command starts."""
    speculative_config: str | None = None
    """The started servers' ``--speculative-config`` (JSON), None: no speculation."""
    slo: float = 0.1
    """Normalised-latency SLO (seconds per output token, mean over requests)."""
    seed: int = 0
    token_id_range: tuple[int, int] = (10, 500)
    """Prompt token ids are drawn here (the demo model's vocabulary is 512)."""
    request_timeout_s: float = 600.0
    startup_timeout_s: float = 300.0
    warmup_requests: int = 2
    stop_after_violations: int = 2
    """Skip a policy's higher rates after this many consecutive SLO violations (0: never)."""
    quick: bool = False
    progress: bool = True
    argv: list[str] | None = None

    def requests_at(self, rate: float) -> int:
        if self.duration_s is None or math.isinf(rate):
            return self.num_requests
        return max(self.min_requests, round(rate * self.duration_s))

    def max_requests(self) -> int:
        return max(self.requests_at(r) for r in self.rates)

    def scaled(self) -> ServingOptions:
        if not self.quick:
            return self
        return replace(
            self, rates=(4.0, 16.0), duration_s=None, num_requests=16, workload="tiny",
            max_model_len=256,
            num_gpu_blocks=33, backend="local", warmup_requests=1, slo=0.04,
            stop_after_violations=0,
        )


# --------------------------------------------------------------------------- the client
async def _stream_one(session: Any, url: str, model: str, ids: list[int], res: RequestResult,
                      timeout_s: float) -> None:
    import aiohttp

    body = {
        "model": model, "prompt": ids, "max_tokens": res.max_tokens, "ignore_eos": True,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    }
    st = time.perf_counter()
    res.send = st
    last = st
    try:
        async with session.post(f"{url}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"].get("message", obj["error"]))[:200]
                    break
                if obj.get("choices"):
                    now = time.perf_counter()
                    if math.isnan(res.ttft):
                        res.ttft = now - st
                    else:
                        res.itl.append(now - last)
                    last = now
                usage = obj.get("usage")
                if usage:
                    res.output_tokens = int(usage.get("completion_tokens", 0))
        res.e2e = time.perf_counter() - st
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]


async def _scrape(session: Any, url: str) -> Any:
    async with session.get(f"{url}/metrics") as resp:
        return parse_metrics(await resp.text())


async def _model_id(session: Any, url: str) -> tuple[str, int | None]:
    async with session.get(f"{url}/v1/models") as resp:
        card = (await resp.json())["data"][0]
        return str(card["id"]), card.get("max_model_len")


async def _run_rate(o: ServingOptions, url: str, model: str, rate: float, index: int,
                    bar: Any) -> dict[str, Any]:
    import aiohttp

    workload = WORKLOADS[o.workload]
    # The same lengths at every rate (only the load changes), fresh token ids at each rate
    # (so that no rate hits the prefix cache of an earlier one).
    n = o.requests_at(rate)
    prompts, outputs = sample_lengths(workload, o.max_requests(), np.random.default_rng(o.seed),
                                      max_total=o.max_model_len)
    prompts, outputs = prompts[:n], outputs[:n]
    rng = np.random.default_rng([o.seed, index])
    sends = arrival_times(n, rate, rng, o.burstiness)
    lo, hi = o.token_id_range
    id_lists = [rng.integers(lo, hi, size=int(p)).tolist() for p in prompts]
    results = [RequestResult(int(p), int(n)) for p, n in zip(prompts, outputs, strict=True)]
    in_flight = 0
    peak = 0

    async def one(i: int, session: Any) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await _stream_one(session, url, model, id_lists[i], results[i], o.request_timeout_s)
        finally:
            in_flight -= 1
            bar.update(1)

    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as session:
        before = await _scrape(session, url)
        t0 = time.perf_counter()
        tasks = []
        for i, at in enumerate(sends):
            delay = t0 + float(at) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, session)))
        during = await _scrape(session, url)  # the last request has just been sent
        await asyncio.gather(*tasks)
        t_end = time.perf_counter()
        after = await _scrape(session, url)
    return summarise(rate, results, t0, t_end, peak, before, during, after)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(o: ServingOptions, policy: str, port: int) -> list[str]:
    cmd = [
        sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(port),
        "--log-level", "warning", "--allocation-policy", policy,
        "--max-model-len", str(o.max_model_len), "--num-gpu-blocks", str(o.num_gpu_blocks),
        "--backend", o.backend, "--model", "demo",  # the random demo checkpoint, by name
    ]
    if o.speculative_config is not None:
        cmd += ["--speculative-config", o.speculative_config]
    return cmd + shlex.split(o.server_args)


@contextlib.contextmanager
def running_server(o: ServingOptions, policy: str) -> Iterator[tuple[str, list[str]]]:
    """Start ``pagedserve serve`` for ``policy``; yield its URL and command; stop it."""
    import urllib.request

    port = _free_port()
    cmd = server_command(o, policy, port)
    log = tempfile.NamedTemporaryFile("w+b", prefix=f"pagedserve-bench-{policy}-",
                                      suffix=".log", delete=False)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + o.startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the {policy} server exited ({proc.returncode}):\n"
                                   + _tail(log.name))
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {policy} server did not come up:\n" + _tail(log.name))
            time.sleep(0.5)
        yield url, cmd
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        with contextlib.suppress(OSError):
            os.unlink(log.name)


def _tail(path: str, n: int = 3000) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")[-n:]


# --------------------------------------------------------------------------- the sweep
async def _sweep(o: ServingOptions, url: str, bar: Any) -> tuple[str, list[dict[str, Any]]]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        model, _ = await _model_id(session, url)
        if o.warmup_requests:
            warm = [RequestResult(8, 4) for _ in range(o.warmup_requests)]
            await asyncio.gather(*[
                _stream_one(session, url, model, list(range(20, 28)), w, o.request_timeout_s)
                for w in warm])
    rows: list[dict[str, Any]] = []
    misses = 0
    for i, rate in enumerate(o.rates):
        if o.stop_after_violations and misses >= o.stop_after_violations:
            bar.update(o.requests_at(rate))  # skipped: past this server's capacity already
            continue
        row = await _run_rate(o, url, model, rate, i, bar)
        rows.append(row)
        misses = 0 if meets(row, o.slo) else misses + 1
    return model, rows


def run_serving(o: ServingOptions) -> dict[str, Any]:
    """Run the sweep as configured (call ``o.scaled()`` first for the ``--quick`` presets)."""
    from tqdm import tqdm

    o.out.mkdir(parents=True, exist_ok=True)
    policies = [o.label] if o.url else list(o.policies)
    bar = tqdm(total=len(policies) * sum(o.requests_at(r) for r in o.rates), unit="req",
               disable=not o.progress, dynamic_ncols=True, mininterval=0.5)
    per: dict[str, Any] = {}
    t_all = time.perf_counter()
    try:
        for name in policies:
            bar.set_description(name)
            t0 = time.perf_counter()
            if o.url:
                model, rows = asyncio.run(_sweep(o, o.url.rstrip("/"), bar))
                cmd = None
            else:
                with running_server(o, name) as (url, cmd_list):
                    model, rows = asyncio.run(_sweep(o, url, bar))
                cmd = " ".join(shlex.quote(c) for c in
                               ["pagedserve", *cmd_list[3:]])  # drop "python -m pagedserve.cli"
            per[name] = {"server_command": cmd, "model": model, "rates": rows,
                         "capacity": capacity(rows, o.slo),
                         "wall_seconds": time.perf_counter() - t0}
    finally:
        bar.close()
    doc: dict[str, Any] = {
        "command": command_line(o.argv),
        "quick": o.quick,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, python "
                   f"{platform.python_version()}",
        "wall_seconds": time.perf_counter() - t_all,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(o).items()
                    if k not in ("argv", "progress")},
        "workload": WORKLOADS[o.workload].description,
        "slo_normalized_latency_s": o.slo,
        "policies": per,
    }
    doc["targets"] = targets(doc)
    write_json(o.out / "serving.json", doc)
    render(doc, o.out)
    print(f"wrote {o.out}/serving.json, serving.md and 2 PNGs "
          f"in {doc['wall_seconds']:.0f} s")
    for name, t in doc["targets"].items():
        print(f"  target {name}: {t['value']} -> {'met' if t['met'] else 'NOT met'}")
    return doc
