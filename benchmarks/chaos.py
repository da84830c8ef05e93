"""Chaos against the HTTP server: a storm of misbehaving clients and a worker killed mid-storm.

The server is the one ``pagedserve serve`` runs (``serving.openai.server.build_app`` over an engine
on Ray: controller actor, worker actor, the demo checkpoint), served by uvicorn in this process
on 127.0.0.1 so that the script can reach the worker actor to kill it. The KV pool is small, so
the engine preempts. The storm mixes streaming and plain clients, clients that disconnect
mid-stream or time out (aborts), invalid parameters, prompts at the edge of ``max_model_len``,
``n > 1`` and shared prefixes; one worker actor is killed part-way through.

Afterwards every client must have a complete answer, a typed error (an OpenAI error body, or
an SSE error event), or be one that left on purpose; ``/metrics`` must show 0 running, 0
waiting and 0 KV blocks in use, with the KV manager's invariants holding; and a greedy request
must give the same text as before the storm. The time from the kill to serving again is
measured. Exit status 1 when any of that fails.

    python benchmarks/chaos.py --out docs/results/reliability.md     # 400 clients, ~2 min
    python benchmarks/chaos.py --quick                                # 60 clients, CI
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx2 as httpx
import ray
import uvicorn

from pagedserve.builder import start_engine
from pagedserve.config import from_flat
from pagedserve.serving.openai.server import build_app
from pagedserve.workers.demo import DEMO_VOCAB_SIZE, write_demo_checkpoint

MAX_MODEL_LEN = 256
GREEDY_PROBE = {"prompt": "Hello, my name is", "max_tokens": 12, "temperature": 0.0}


def _serve(app: Any) -> tuple[uvicorn.Server, threading.Thread, str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def _metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r"^pagedserve_(\w+) ([-0-9.e+]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _is_error_body(body: Any) -> bool:
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and bool(
        body["error"].get("message"))


def _plan(rng: random.Random, i: int) -> dict[str, Any]:
    """One client's behaviour and request body."""
    kind = rng.choice(["plain", "stream", "stream", "disconnect", "timeout", "bad", "edge",
                       "parallel", "prefix"])
    body: dict[str, Any] = {"prompt": f"client {i} says", "max_tokens": rng.randint(4, 40),
                            "temperature": rng.choice([0.0, 0.7]), "seed": i}
    if kind == "bad":
        body[rng.choice(["temperature", "top_p", "max_tokens", "n"])] = -3
    elif kind == "edge":  # token ids at the edge of the context: fits, or a typed 400
        n = MAX_MODEL_LEN - rng.randint(0, 8)
        body = {"prompt": [rng.randrange(3, DEMO_VOCAB_SIZE) for _ in range(n)],
                "max_tokens": rng.randint(1, 8)}
    elif kind == "parallel":
        body["n"] = rng.randint(2, 4)
    elif kind == "prefix":
        body["prompt"] = "A shared system prompt that many clients send first. " * 3 + str(i)
    body["stream"] = kind in ("stream", "disconnect") or (kind == "prefix" and i % 2 == 0)
    return {"kind": kind, "body": body, "leave_after": rng.randint(1, 5)}


async def _client(http: httpx.AsyncClient, plan: dict[str, Any]) -> str:
    """Run one client; returns its outcome: complete, typed-error, left or drop:<why>."""
    body, kind = plan["body"], plan["kind"]
    try:
        if kind == "timeout":  # gives up before the answer: the server must abort it
            try:
                await http.post("/v1/completions", json={**body, "max_tokens": 200,
                                                         "ignore_eos": True}, timeout=0.3)
            except httpx.TimeoutException:
                return "left"
        if not body.get("stream"):
            resp = await http.post("/v1/completions", json=body)
            data = resp.json()
            if resp.status_code != 200:
                return "typed-error" if _is_error_body(data) else f"drop:{resp.status_code}"
            ok = all(c.get("finish_reason") for c in data["choices"])
            return "complete" if ok else "drop:unfinished"
        finished: set[int] = set()
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                data = json.loads(await resp.aread())
                return "typed-error" if _is_error_body(data) else f"drop:{resp.status_code}"
            events = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    want = body.get("n", 1)
                    return "complete" if len(finished) == want else "drop:unfinished-stream"
                chunk = json.loads(payload)
                if _is_error_body(chunk):
                    return "typed-error"
                for c in chunk["choices"]:
                    if c.get("finish_reason"):
                        finished.add(c["index"])
                events += 1
                if kind == "disconnect" and events >= plan["leave_after"]:
                    return "left"  # closing the stream mid-way: the server aborts
        return "drop:no-done"
    except (httpx.TransportError, json.JSONDecodeError, KeyError) as exc:
        return f"drop:{type(exc).__name__}"


async def _storm(url: str, plans: list[dict[str, Any]], concurrency: int,
                 kill_at: int, kill: Any) -> tuple[Counter[str], float | None]:
    outcomes: Counter[str] = Counter()
    sem = asyncio.Semaphore(concurrency)
    recovered_s: float | None = None
    done = 0

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        async def one(plan: dict[str, Any]) -> None:
            nonlocal done
            async with sem:
                outcomes[await _client(http, plan)] += 1
                done += 1

        async def killer() -> None:
            nonlocal recovered_s
            while done < kill_at:
                await asyncio.sleep(0.05)
            t_kill = time.monotonic()
            await asyncio.to_thread(kill)
            deadline = t_kill + 180
            while time.monotonic() < deadline:  # serving again: a probe completes
                try:
                    resp = await http.post("/v1/completions", json=GREEDY_PROBE, timeout=30)
                    if resp.status_code == 200:
                        recovered_s = time.monotonic() - t_kill
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.2)

        await asyncio.gather(killer(), *(one(p) for p in plans))
    return outcomes, recovered_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--clients", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-gpu-blocks", type=int, default=64, help="small, so the engine preempts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="60 clients (CI)")
    ap.add_argument("--out", default=None, help="write the report (markdown) here")
    args = ap.parse_args()
    if args.quick:
        args.clients, args.concurrency = 60, 12
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="pagedserve-chaos-"))
    model = write_demo_checkpoint(work / "demo-model")
    config = from_flat(model=str(model), dtype="float32", block_size=16,
                       max_model_len=MAX_MODEL_LEN, num_gpu_blocks=args.num_gpu_blocks,
                       max_num_seqs=16, max_num_batched_tokens=512)
    t0 = time.monotonic()
    client: Any = start_engine(config, "ray")
    server, thread, url = _serve(build_app(client))
    print(f"server up at {url} in {time.monotonic() - t0:.1f} s (Ray controller + 1 worker)")
    report: dict[str, Any] = {}
    try:
        with httpx.Client(base_url=url, timeout=120) as http:
            before = http.post("/v1/completions", json=GREEDY_PROBE).json()["choices"][0]["text"]

        def kill() -> None:
            (worker,) = ray.get(client.actor.worker_actors.remote(), timeout=30)
            ray.kill(worker, no_restart=True)

        plans = [_plan(rng, i) for i in range(args.clients)]
        t_storm = time.monotonic()
        outcomes, recovered_s = asyncio.run(
            _storm(url, plans, args.concurrency, args.clients // 3, kill))
        storm_s = time.monotonic() - t_storm
        with httpx.Client(base_url=url, timeout=120) as http:
            # Idle, and the engine's integrity check has run since the storm ended.
            checks = _metrics(http.get("/metrics").text).get("kv_cache_integrity_checks_total", 0)
            deadline, idle = time.monotonic() + 60, {}
            while time.monotonic() < deadline:
                idle = _metrics(http.get("/metrics").text)
                if (idle.get("num_requests_running") == 0 and idle.get("num_requests_waiting")
                        == 0 and idle.get("kv_cache_blocks_used") == 0
                        and idle.get("kv_cache_integrity_checks_total", 0) > checks):
                    break
                time.sleep(0.1)
            after = http.post("/v1/completions", json=GREEDY_PROBE).json()["choices"][0]["text"]
        drops = {k: v for k, v in outcomes.items() if k.startswith("drop")}
        report = {
            "clients": args.clients, "num_gpu_blocks": args.num_gpu_blocks,
            "storm_s": storm_s, "outcomes": dict(outcomes),
            "drops": sum(drops.values()), "kills": 1, "recovered": recovered_s is not None,
            "kill_to_serving_s": recovered_s, "preemptions": idle.get("num_preemptions", 0),
            "blocks_leaked": idle.get("kv_cache_blocks_used"),
            "running": idle.get("num_requests_running"),
            "waiting": idle.get("num_requests_waiting"),
            "kv_integrity_ok": idle.get("kv_cache_integrity_ok"),
            "same_text_after": after == before,
        }
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        client.shutdown()
    ok = (report["drops"] == 0 and report["recovered"] and report["blocks_leaked"] == 0
          and report["running"] == 0 and report["waiting"] == 0
          and report["kv_integrity_ok"] == 1 and report["same_text_after"])
    print(json.dumps(report, indent=2))
    if args.out:
        _write(Path(args.out), report, " ".join(sys.argv[1:]))
    print("chaos: PASS" if ok else "chaos: FAIL")
    return 0 if ok else 1


def _write(path: Path, r: dict[str, Any], argv: str) -> None:
    lines = [
        "# Reliability: a chaos storm against the HTTP server", "",
        f"Command: `python benchmarks/chaos.py {argv}`", "",
        "The server of `pagedserve serve` (Ray controller actor and one worker actor, the demo",
        f"checkpoint, a {r['num_gpu_blocks']}-block KV pool so that the engine preempts) takes",
        "a storm of clients:",
        "streaming and plain, clients leaving mid-stream or timing out, invalid parameters,",
        "prompts at the edge of the context, `n > 1`, shared prefixes; its worker actor is",
        "killed a third of the way through.", "",
        "| measure | value |", "|---|---|",
        f"| clients | {r['clients']} (storm {r['storm_s']:.1f} s) |",
        *(f"| outcome `{k}` | {v} |" for k, v in sorted(r["outcomes"].items())),
        f"| drops (no complete answer, no typed error) | {r['drops']} |",
        f"| worker kills / recoveries | {r['kills']} / {int(r['recovered'])} |",
        f"| kill to serving again | {r['kill_to_serving_s']:.1f} s |"
        if r["kill_to_serving_s"] is not None else "| kill to serving again | never |",
        f"| preemptions (since the rebuild) | {r['preemptions']:.0f} |",
        f"| after the storm: running / waiting / KV blocks in use | {r['running']:.0f} / "
        f"{r['waiting']:.0f} / {r['blocks_leaked']:.0f} |",
        "| KV manager invariants when idle | "
        f"{'hold' if r['kv_integrity_ok'] == 1 else 'BROKEN'} |",
        f"| greedy text after = before | {r['same_text_after']} |", "",
        "`left` counts the clients that hung up on purpose (their requests are aborted);",
        "`typed-error` counts OpenAI error bodies (400 for bad parameters or too long prompts,",
        "503 for requests the dead worker failed) and SSE error events.",
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
