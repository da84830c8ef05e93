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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from pagedserve.bench.prom import Histogram, histogram_quantile, parse_metrics
from pagedserve.bench.report import command_line, md_table, write_json
from pagedserve.bench.workloads import WORKLOADS, arrival_times, sample_lengths

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

BATCHED_TOKENS = "pagedserve_batched_tokens_per_step"
PREEMPTIONS = "pagedserve_num_preemptions_total"
STEPS = "pagedserve_engine_steps_total"


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


@dataclass
class RequestResult:
    prompt_tokens: int
    max_tokens: int
    send: float = 0.0
    ttft: float = math.nan
    e2e: float = math.nan
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_tokens > 0


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
    return _summarise(rate, results, t0, t_end, peak, before, during, after)


def _pct(xs: list[float] | np.ndarray, q: float) -> float:
    a = np.asarray(xs, dtype=float)
    a = a[np.isfinite(a)]
    return float(np.percentile(a, q)) if a.size else math.nan


def _mean(xs: list[float] | np.ndarray) -> float:
    a = np.asarray(xs, dtype=float)
    a = a[np.isfinite(a)]
    return float(a.mean()) if a.size else math.nan


def _summarise(rate: float, results: list[RequestResult], t0: float, t_end: float, peak: int,
               before: Any, during: Any, after: Any) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    e2e = [r.e2e for r in ok]
    ttft = [r.ttft for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    norm = [r.e2e / r.output_tokens for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    duration = max(1e-9, (max(r.send + r.e2e for r in ok) - t0) if ok else t_end - t0)
    first = before.histogram(BATCHED_TOKENS)
    whole: Histogram = after.histogram(BATCHED_TOKENS).minus(first)
    load: Histogram = during.histogram(BATCHED_TOKENS).minus(first)
    return {
        "rate": rate,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "peak_concurrency": peak,
        "e2e_mean": _mean(e2e), "e2e_p50": _pct(e2e, 50), "e2e_p99": _pct(e2e, 99),
        "normalized_latency_mean": _mean(norm),
        "normalized_latency_p50": _pct(norm, 50),
        "normalized_latency_p99": _pct(norm, 99),
        "ttft_mean": _mean(ttft), "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
        "tpot_mean": _mean(tpot), "tpot_p50": _pct(tpot, 50), "tpot_p99": _pct(tpot, 99),
        "itl_p50": _pct(itl, 50), "itl_p99": _pct(itl, 99),
        "sse_events_per_output_token": (
            (len(itl) + len(ok)) / out_tokens if out_tokens else math.nan),
        "preemptions": after.value(PREEMPTIONS) - before.value(PREEMPTIONS),
        "engine_steps": after.value(STEPS) - before.value(STEPS),
        # While requests were still arriving (under load), and over the whole run (drain too).
        "batched_tokens": _hist_summary(load),
        "batched_tokens_whole_run": _hist_summary(whole),
        "requests": [
            {"prompt": r.prompt_tokens, "output": r.output_tokens, "ttft": r.ttft,
             "e2e": r.e2e, "error": r.error}
            for r in results
        ],
    }


def _hist_summary(h: Histogram) -> dict[str, Any]:
    return {
        "steps": h.count,
        "mean": h.sum / h.count if h.count else math.nan,
        "p10": histogram_quantile(h, 0.1, integer=True),
        "median": histogram_quantile(h, 0.5, integer=True),
        "p90": histogram_quantile(h, 0.9, integer=True),
        "bounds": h.bounds,
        "counts": h.counts(),
    }


# --------------------------------------------------------------------------- servers
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
        misses = 0 if _meets(row, o.slo) else misses + 1
    return model, rows


def _meets(row: dict[str, Any], slo: float) -> bool:
    lat = row["normalized_latency_mean"]
    return row["failed"] == 0 and lat is not None and math.isfinite(lat) and lat <= slo


def capacity(rows: list[dict[str, Any]], slo: float) -> dict[str, Any]:
    """Highest swept rate up to which every rate meets the SLO (and completes every request),
    and a linear interpolation to the crossing point."""
    best = None
    crossing = None
    prev = None
    for r in sorted(rows, key=lambda r: r["rate"]):
        lat = r["normalized_latency_mean"]
        if not _meets(r, slo):
            if prev is not None and math.isfinite(lat):
                r0, l0 = prev["rate"], prev["normalized_latency_mean"]
                crossing = r0 + (slo - l0) * (r["rate"] - r0) / max(1e-12, lat - l0)
            break
        best, prev = r["rate"], r
    return {
        "max_rate_meeting_slo": best,
        "interpolated": crossing if crossing is not None else best,
        "bounded": crossing is not None,
        "note": None if crossing is not None else (
            "no swept rate violated the SLO: the capacity is at least the highest rate"
            if best is not None else "even the lowest rate violated the SLO"),
    }


def run_serving(o: ServingOptions) -> dict[str, Any]:
    """Run the sweep as configured (call ``o.scaled()`` first for the ``--quick`` presets)."""
    from tqdm import tqdm

    o.out.mkdir(parents=True, exist_ok=True)
    targets = [o.label] if o.url else list(o.policies)
    bar = tqdm(total=len(targets) * sum(o.requests_at(r) for r in o.rates), unit="req",
               disable=not o.progress, dynamic_ncols=True, mininterval=0.5)
    per: dict[str, Any] = {}
    t_all = time.perf_counter()
    try:
        for name in targets:
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
    doc["targets"] = _targets(doc)
    write_json(o.out / "serving.json", doc)
    render(doc, o.out)
    print(f"wrote {o.out}/serving.json, serving.md and 2 PNGs "
          f"in {doc['wall_seconds']:.0f} s")
    for name, t in doc["targets"].items():
        print(f"  target {name}: {t['value']} -> {'met' if t['met'] else 'NOT met'}")
    return doc


def render(doc: dict[str, Any], out: Path) -> None:
    """Write ``serving.md`` and the PNGs from a results document (``serving.json``)."""
    from pagedserve.bench import plots

    per = doc["policies"]
    plots.serving_latency({k: v["rates"] for k, v in per.items()},
                          doc["slo_normalized_latency_s"], out / "serving_latency.png",
                          {k: v["capacity"]["interpolated"] for k, v in per.items()})
    plots.serving_batched_tokens(_loaded_hists(per), out / "serving_batched_tokens.png")
    (out / "serving.md").write_text(_markdown(doc))


def replot(out: Path) -> dict[str, Any]:
    """Redraw the figures and tables of an earlier run from ``out/serving.json``."""
    doc = json.loads((out / "serving.json").read_text())
    render(doc, out)
    print(f"redrew {out}/serving.md and 2 PNGs from serving.json")
    return doc


def _loaded_hists(per: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each policy's batched-tokens histogram (load window) at its highest rate swept."""
    out = {}
    for name, p in per.items():
        if p["rates"]:
            top = max(p["rates"], key=lambda r: r["rate"])
            out[name] = {"rate": top["rate"], **top["batched_tokens"]}
    return out


def _targets(doc: dict[str, Any]) -> dict[str, Any]:
    per = doc["policies"]
    if "paged" not in per or "reserve" not in per:
        return {}
    cp, cr = per["paged"]["capacity"], per["reserve"]["capacity"]
    ratio = None
    if cp["interpolated"] and cr["interpolated"]:
        ratio = cp["interpolated"] / cr["interpolated"]
    grid = None
    if cp["max_rate_meeting_slo"] and cr["max_rate_meeting_slo"]:
        grid = cp["max_rate_meeting_slo"] / cr["max_rate_meeting_slo"]
    hp, hr = _loaded_hists(per)["paged"], _loaded_hists(per)["reserve"]
    med = hp["median"] / hr["median"] if hr["median"] else None
    common = sorted({r["rate"] for r in per["paged"]["rates"]}
                    & {r["rate"] for r in per["reserve"]["rates"]})
    at_common = None
    if common:
        rate = common[-1]
        mp = next(r for r in per["paged"]["rates"] if r["rate"] == rate)["batched_tokens"]
        mr = next(r for r in per["reserve"]["rates"] if r["rate"] == rate)["batched_tokens"]
        at_common = {"rate": rate, "paged": mp["median"], "reserve": mr["median"],
                     "ratio": mp["median"] / mr["median"] if mr["median"] else None}
    return {
        "sustained_rate_paged_over_reserve_at_least_2x": {
            "value": {"interpolated": ratio, "swept_grid": grid,
                      "paged": cp, "reserve": cr},
            "met": ratio is not None and ratio >= 2.0,
        },
        "median_batched_tokens_paged_over_reserve_at_least_2x": {
            "value": {"ratio": med, "paged": hp["median"], "reserve": hr["median"],
                      "paged_rate": hp["rate"], "reserve_rate": hr["rate"],
                      "at_highest_common_rate": at_common},
            "met": med is not None and med >= 2.0,
        },
    }


# --------------------------------------------------------------------------- markdown
def _f(x: Any, nd: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _markdown(doc: dict[str, Any]) -> str:
    o = doc["options"]
    out = [
        "# Serving: request-rate sweep over HTTP, paged against reserve",
        "",
        "Produced by (the JSON beside this file holds every number, per request too):",
        "",
        "```",
        doc["command"],
        "```",
        "",
        f"Workload: {doc['workload']}; "
        + (f"arrivals over {o['duration_s']:g} s at every rate (rate x {o['duration_s']:g} "
           f"requests, at least {o['min_requests']})" if o["duration_s"] else
           f"{o['num_requests']} requests per rate")
        + "; Gamma arrivals "
        f"(burstiness {o['burstiness']:g}: Poisson), token-id prompts, `max_tokens` = the "
        "sampled output length with `ignore_eos`, streamed from `/v1/completions` and timed "
        "per server-sent event. Normalised latency = E2E / output tokens, mean over requests "
        f"(the paper's metric); SLO {doc['slo_normalized_latency_s']:g} s/token. "
        f"{doc['machine']}; {doc['wall_seconds']:.0f} s wall"
        + (" (`--quick`)." if doc["quick"] else "."),
        "",
    ]
    for name, p in doc["policies"].items():
        cap = p["capacity"]
        out += [
            f"## `{name}`",
            "",
            f"Server: `{p['server_command'] or o['url']}` (model `{p['model']}`).",
            "",
            f"Highest swept rate meeting the SLO: **{_f(cap['max_rate_meeting_slo'], 2)}** "
            f"req/s (interpolated crossing {_f(cap['interpolated'], 2)})"
            + (f"; {cap['note']}" if cap["note"] else "") + ".",
            "",
            md_table(
                ["rate", "done", "req/s", "out tok/s", "E2E mean / P99 (s)",
                 "norm. lat. mean / P99 (s/tok)", "TTFT P50 / P99 (s)",
                 "TPOT P50 / P99 (ms)", "ITL P99 (ms)", "preempt.",
                 "batched tok/step P10 / P50 / P90 (while arriving)", "peak conc."],
                [[f"{r['rate']:g}", f"{r['completed']}/{r['num_requests']}",
                  _f(r["request_throughput"], 2), _f(r["output_throughput"], 0),
                  f"{_f(r['e2e_mean'], 1)} / {_f(r['e2e_p99'], 1)}",
                  f"{_f(r['normalized_latency_mean'])} / {_f(r['normalized_latency_p99'])}",
                  f"{_f(r['ttft_p50'], 2)} / {_f(r['ttft_p99'], 2)}",
                  f"{_ms(r['tpot_p50'])} / {_ms(r['tpot_p99'])}", _ms(r["itl_p99"]),
                  f"{r['preemptions']:.0f}",
                  f"{_f(r['batched_tokens']['p10'], 1)} / "
                  f"{_f(r['batched_tokens']['median'], 1)} / "
                  f"{_f(r['batched_tokens']['p90'], 1)}",
                  str(r["peak_concurrency"])]
                 for r in p["rates"]],
            ),
            "",
        ]
    if doc["targets"]:
        t1 = doc["targets"]["sustained_rate_paged_over_reserve_at_least_2x"]
        t2 = doc["targets"]["median_batched_tokens_paged_over_reserve_at_least_2x"]
        v1, v2 = t1["value"], t2["value"]
        out += [
            "## Targets",
            "",
            md_table(["target", "measured", "met"], [
                ["paged sustains >= 2x the rate of reserve under the SLO",
                 f"{_f(v1['interpolated'], 2)}x interpolated ({_f(v1['swept_grid'], 2)}x on "
                 "the swept grid)", "yes" if t1["met"] else "**no**"],
                ["median batched tokens per step under load >= 2x reserve",
                 f"{_f(v2['ratio'], 2)}x ({_f(v2['paged'], 1)} at {v2['paged_rate']:g} req/s "
                 f"vs {_f(v2['reserve'], 1)} at {v2['reserve_rate']:g} req/s, each policy's "
                 "highest rate)" + _common(v2["at_highest_common_rate"]),
                 "yes" if t2["met"] else "**no**"],
            ]),
            "",
        ]
    out += ["Batched tokens per step come from the server's "
            "`pagedserve_batched_tokens_per_step` histogram, scraped before the first request "
            "of a rate and right after its last request was sent (the load window; the JSON "
            "also has the whole run, drain included). Quantiles are interpolated inside the "
            "histogram's buckets. A policy's higher rates are skipped after "
            f"{o['stop_after_violations']} consecutive rates miss the SLO.", "",
            "Plots: `serving_latency.png` (mean and P99 normalised latency against rate), "
            "`serving_batched_tokens.png` (tokens per step at each policy's highest rate).",
            ""]
    return "\n".join(out)


def _common(c: dict[str, Any] | None) -> str:
    if not c:
        return ""
    return (f"; at {c['rate']:g} req/s, the highest rate both ran: {_f(c['paged'], 1)} vs "
            f"{_f(c['reserve'], 1)} ({_f(c['ratio'], 2)}x)")


def _ms(x: Any) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{1000 * x:.0f}"

