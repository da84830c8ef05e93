"""Chaos against the HTTP server: a storm of misbehaving clients while the worker is killed
twice and the controller once, then hostile clients beside well-behaved ones.

The server is the one ``pagedserve serve`` runs (``serving.openai.server.build_app`` over an engine
on Ray: controller actor, worker actor, the demo checkpoint), served by uvicorn in this process
on 127.0.0.1 so that the script can reach the actors to kill them. The KV pool is small, and
the report counts the preemptions it causes. The storm mixes streaming and plain clients,
clients that disconnect mid-stream or time out (aborts), invalid parameters, prompts at the
edge of ``max_model_len``, ``n > 1``, shared prefixes and a share of the hostile clients of
issue 27 (``chaos_hostile``: ints past int64, lone surrogates, a 3 MB prompt, logprob bombs,
thousands of stop strings, clients that never read their stream or hang up). Part-way through,
three faults strike one after the other, each once the server serves again after the one
before: the worker actor is killed, then the controller actor, then the (new) worker actor.
A worker's death is survived by its controller, which rebuilds the worker group; a
controller's by the front end, which starts a new one and moves its requests there.

Afterwards every client must have what a well-run server gives it: a complete answer (every
well-behaved request, faults or not: a fault costs latency only), a typed error (an OpenAI
error body, or an SSE error event, for invalid requests), or be one that left on purpose. A
failed request (a well-behaved one without its complete answer, or any broken answer) is
counted against the fault whose outage it overlapped. A greedy witness stream runs across
each fault and must give the text of an uninterrupted run; ``/metrics`` must show 0 running,
0 waiting and 0 KV blocks in use, with the KV manager's invariants holding; and a greedy
request must give the same text as before the storm. The time from each kill to serving again
is measured. Then the same well-behaved storm runs twice, alone and beside hostile clients:
every well-behaved request must complete, and their P99 latency beside the hostile ones must
stay within ``--max-ratio`` (2x) of it alone (``--quick`` reports that ratio without bounding
it: a timing on a shared CI machine is not a pass condition). Exit status 1 when any of that
fails.

    python benchmarks/scripts/chaos.py --out docs/results/reliability.md  # 400 + 2 x (2 x 200)
    python benchmarks/scripts/chaos.py --quick                            # 60 + 3 x (2 x 60), CI
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx2 as httpx
import ray

from pagedserve.builder import start_engine
from pagedserve.config import from_flat
from pagedserve.serving.openai.server import build_app
from pagedserve.workers.demo import DEMO_VOCAB_SIZE, write_demo_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, when imported
import chaos_hostile  # noqa: E402
from chaos_common import (  # noqa: E402
    RESULTS_TITLE,
    ProbeProcess,
    percentile,
    serve,
    wait_idle,
)
from results_section import write_section  # noqa: E402

MAX_MODEL_LEN = 256
GREEDY_PROBE = {"prompt": "Hello, my name is", "max_tokens": 12, "temperature": 0.0}
FAULTS = ("worker", "controller", "worker")  # the storm's kills, in order
# Streams across a fault: long enough that the kill lands while it runs.
WITNESS = {"prompt": "A witness streams across the fault:", "max_tokens": 160,
           "temperature": 0.0, "ignore_eos": True, "stream": True}


def _is_error_body(body: Any) -> bool:
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and bool(
        body["error"].get("message"))


STORM_KINDS = ("plain", "stream", "stream", "disconnect", "timeout", "bad", "edge", "parallel",
               "prefix")
WELL_BEHAVED = ("plain", "stream", "stream", "parallel", "prefix")  # each must complete


def _plan(rng: random.Random, i: int, kinds: tuple[str, ...] = STORM_KINDS,
          hostile_share: float = 0.0) -> dict[str, Any]:
    """One client's behaviour and request body."""
    if rng.random() < hostile_share:
        return chaos_hostile.plan(rng)
    kind = rng.choice(kinds)
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


def _acceptable(plan: dict[str, Any], outcome: str, expected: str | None) -> bool:
    """What a well-run server gives this client, whatever fault strikes meanwhile."""
    if outcome.startswith("drop"):
        return False
    if plan.get("hostile"):  # a client that hung up may have had its answer first
        return outcome == expected or (outcome == "complete" and expected == "left")
    kind = plan["kind"]
    if kind in WELL_BEHAVED:
        return outcome == "complete"
    if kind == "bad":
        return outcome == "typed-error"
    if kind in ("disconnect", "timeout"):  # valid requests whose clients leave
        return outcome in ("left", "complete")
    return True  # "edge": fits, or a typed 400


async def _client(http: httpx.AsyncClient, plan: dict[str, Any]) -> str:
    """Run one client; returns its outcome: complete, typed-error, left or drop:<why>."""
    if plan.get("hostile"):
        outcome, plan["expected"] = await chaos_hostile.run(http, plan)
        return outcome
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


async def _witness(http: httpx.AsyncClient, started: asyncio.Event) -> tuple[str, int, bool]:
    """Stream ``WITNESS``, setting ``started`` at its first text: (its text, the number of
    chunks, whether it ended as a complete stream: every completion finished, then [DONE])."""
    text, chunks, finished = "", 0, False
    async with http.stream("POST", "/v1/completions", json=WITNESS) as resp:
        if resp.status_code != 200:
            return "", 0, False
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                return text, chunks, finished
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if _is_error_body(chunk):
                return text, chunks, False
            choice = chunk["choices"][0]
            text += choice.get("text") or ""
            finished = finished or bool(choice.get("finish_reason"))
            chunks += 1
            started.set()
    return text, chunks, False


async def _storm(url: str, plans: list[dict[str, Any]], concurrency: int,
                 faults: list[tuple[str, int]], kill: Any, probe_text: str,
                 witness_text: str) -> tuple[Counter[str], list[dict[str, Any]], Counter[str]]:
    """The clients of ``plans``, ``concurrency`` at a time, while ``faults`` strike: each
    ``(kind, n)`` once ``n`` clients are done and the one before is over (the server serves
    again), with a witness stream across it. The outcomes; per fault the time to serve
    again, the witness, and the clients whose run overlapped its outage and of them the
    failed ones; and the failed clients in all, counted by kind and outcome."""
    outcomes: Counter[str] = Counter()
    runs: list[tuple[float, float, bool]] = []  # (start, end, acceptable) per client
    failed: Counter[str] = Counter()
    report: list[dict[str, Any]] = []
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        async def one(plan: dict[str, Any]) -> None:
            nonlocal done
            async with sem:
                t0 = time.monotonic()
                outcome = await _client(http, plan)
                outcomes[outcome] += 1
                ok = _acceptable(plan, outcome, plan.get("expected"))
                runs.append((t0, time.monotonic(), ok))
                if not ok:
                    failed[f"{plan['kind']} {outcome}"] += 1
                done += 1

        async def strike(kind: str) -> dict[str, Any]:
            started = asyncio.Event()
            # Awaited at the end, so that the next fault does not wait for it.
            witnesses.append(asyncio.create_task(_witness(http, started)))
            await asyncio.wait_for(started.wait(), 60)
            t_kill = time.monotonic()
            await asyncio.to_thread(kill, kind)
            fault: dict[str, Any] = {"kind": kind, "t": t_kill, "recovered_s": None,
                                     "same_text": False}
            while time.monotonic() < t_kill + 180:  # serving again: a probe completes
                try:
                    resp = await http.post("/v1/completions", json=GREEDY_PROBE, timeout=60)
                    if resp.status_code == 200:
                        fault["recovered_s"] = time.monotonic() - t_kill
                        fault["same_text"] = resp.json()["choices"][0]["text"] == probe_text
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.2)
            return fault

        async def faulter() -> None:
            for kind, at in faults:
                while done < at:
                    await asyncio.sleep(0.05)
                report.append(await strike(kind))
            for fault, witness in zip(report, witnesses, strict=True):
                text, chunks, complete = await witness
                fault["witness_equal"] = complete and text == witness_text
                fault["witness_chunks"] = chunks

        witnesses: list[asyncio.Task[tuple[str, int, bool]]] = []
        await asyncio.gather(faulter(), *(one(p) for p in plans))
    for fault in report:  # a failure counts against the outage it overlapped
        start = fault.pop("t")
        end = start + (fault["recovered_s"] or math.inf)
        fault["in_flight"] = sum(t0 <= end and t1 >= start for t0, t1, _ in runs)
        fault["failed"] = sum(t0 <= end and t1 >= start and not ok for t0, t1, ok in runs)
    return outcomes, report, failed


async def _beside(url: str, good: list[dict[str, Any]], concurrency: int, hostile_clients: int,
                  rng: random.Random) -> dict[str, Any]:
    """The well-behaved clients ``good`` (``concurrency`` at a time), with ``hostile_clients``
    hostile ones sending for as long as they run (each pausing 0.05-0.25 s between requests:
    a share of the traffic, not a flood from this very process, whose GIL the server's event
    loop shares); latencies of the well-behaved and every outcome."""
    good_out: Counter[str] = Counter()
    hostile_out: Counter[str] = Counter()
    unexpected: Counter[str] = Counter()
    latencies: list[float] = []
    sem, finished = asyncio.Semaphore(concurrency), asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=120) as http, \
            httpx.AsyncClient(base_url=url, timeout=120) as hostile_http:
        async def one(plan: dict[str, Any]) -> None:
            async with sem:
                t0 = time.monotonic()
                outcome = await _client(http, plan)
                good_out[outcome] += 1
                if outcome == "complete":
                    latencies.append(time.monotonic() - t0)

        async def all_good() -> None:
            await asyncio.gather(*(one(p) for p in good))
            finished.set()

        async def hostile() -> None:
            while not finished.is_set():
                plan = chaos_hostile.plan(rng)
                outcome, expected = await chaos_hostile.run(hostile_http, plan)
                hostile_out[f"{plan['kind']} {outcome}"] += 1
                # A refusal the server should give but did not (or the reverse) is a bug too;
                # a client that hung up may have had its answer first.
                if outcome != expected and not (outcome == "complete" and expected == "left"):
                    unexpected[f"{plan['kind']} {outcome}"] += 1
                await asyncio.sleep(rng.uniform(0.05, 0.25))

        t0 = time.monotonic()
        await asyncio.gather(all_good(), *(hostile() for _ in range(hostile_clients)))
    return {"storm_s": time.monotonic() - t0, "good": good_out, "hostile": hostile_out,
            "unexpected": unexpected, "latencies": latencies}


def _compare(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The same well-behaved storm without hostile clients and with them, alternating for
    ``--rounds`` rounds (so that a drift of the machine's load falls on both alike): the same
    kinds, lengths and sampling (one seed), prompts of other clients' numbers (so that no storm
    has a prefix-cache head start), /health probed throughout. Latencies pooled per side."""
    out: dict[str, Any] = {name: {"storm_s": 0.0, "good": Counter(), "hostile": Counter(),
                                  "unexpected": Counter(), "latencies": [],
                                  "health": {"max_ms": 0.0, "p99_ms": 0.0}}
                           for name in ("baseline", "hostile")}
    for round_ in range(args.rounds):
        for side, (name, hostile) in enumerate((("baseline", 0), ("hostile", args.hostile))):
            rng = random.Random(args.seed + 1)
            offset = 10_000 * (1 + 2 * round_ + side)
            good = [_plan(rng, offset + i, WELL_BEHAVED) for i in range(args.well_behaved)]
            probe = ProbeProcess(url)
            probe.start()
            one = asyncio.run(_beside(url, good, args.concurrency, hostile,
                                      random.Random(args.seed + 2 + round_)))
            health, acc = probe.stop(), out[name]
            acc["storm_s"] += one["storm_s"]
            acc["latencies"] += one["latencies"]
            acc["good"].update(one["good"])
            acc["hostile"].update(one["hostile"])
            acc["unexpected"].update(one["unexpected"])
            for k in ("max_ms", "p99_ms"):
                acc["health"][k] = max(acc["health"][k], health[k])
    for acc in out.values():
        acc["p50_s"], acc["p99_s"] = (percentile(acc["latencies"], q) for q in (0.5, 0.99))
        acc["good"], acc["hostile"] = dict(acc["good"]), dict(sorted(acc["hostile"].items()))
        acc["unexpected"] = dict(acc["unexpected"])
        del acc["latencies"]
    out["ratio"] = out["hostile"]["p99_s"] / max(out["baseline"]["p99_s"], 1e-9)
    out["hostile_drops"] = sum(v for k, v in out["hostile"]["hostile"].items() if " drop" in k)
    out["hostile_unexpected"] = out["hostile"]["unexpected"]
    out["good_failed"] = sum(v for r in (out["baseline"], out["hostile"])
                             for k, v in r["good"].items() if k != "complete")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--clients", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-gpu-blocks", type=int, default=64,
                    help="small (the report counts preemptions)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hostile-share", type=float, default=0.1,
                    help="of the kill storm's clients, hostile ones (chaos_hostile)")
    ap.add_argument("--well-behaved", type=int, default=200,
                    help="clients of each of the two storms compared, without and with hostile")
    ap.add_argument("--hostile", type=int, default=8, help="hostile clients beside them")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the two, alternating")
    ap.add_argument("--max-ratio", type=float, default=2.0,
                    help="bound on the well-behaved P99 with hostile clients over without")
    ap.add_argument("--quick", action="store_true",
                    help="60 + 3 rounds of 2 x 60 clients; the P99 ratio reported, not bound "
                         "(CI, beside other tests)")
    ap.add_argument("--out", default=None, help="write the report (markdown) here")
    args = ap.parse_args()
    if args.quick:
        # Three rounds pooled, so that the P99 is not just the slowest of a few dozen. The
        # ratio is a timing: CI runs this beside other tests, whose bursts fall on one side
        # (a full-suite run once read 3.93x), so the quick run checks only what holds on any
        # machine (no drops, no leaks, recovery, the same text) and reports the ratio.
        args.clients, args.concurrency, args.well_behaved, args.hostile = 60, 12, 60, 4
        args.rounds, args.max_ratio = 3, math.inf
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="pagedserve-chaos-"))
    model = write_demo_checkpoint(work / "demo-model")
    config = from_flat(model=str(model), dtype="float32", block_size=16,
                       max_model_len=MAX_MODEL_LEN, num_gpu_blocks=args.num_gpu_blocks,
                       max_num_seqs=16, max_num_batched_tokens=512)
    t0 = time.monotonic()
    client: Any = start_engine(config, "ray")
    server, thread, url = serve(build_app(client))
    print(f"server up at {url} in {time.monotonic() - t0:.1f} s (Ray controller + 1 worker)")
    report: dict[str, Any] = {}
    try:
        with httpx.Client(base_url=url, timeout=120) as http:
            before = http.post("/v1/completions", json=GREEDY_PROBE).json()["choices"][0]["text"]
            witness = http.post("/v1/completions", json={**WITNESS, "stream": False}).json()

        def kill(kind: str) -> None:
            (replica,) = client.replicas
            if kind == "controller":
                ray.kill(replica.actor, no_restart=True)
                return
            (worker,) = ray.get(replica.actor.worker_actors.remote(), timeout=30)
            ray.kill(worker, no_restart=True)

        plans = [_plan(rng, i, hostile_share=args.hostile_share) for i in range(args.clients)]
        # Within the storm's first half: each outage stalls it, and the next fault finds
        # clients in flight.
        faults = [(kind, args.clients * (i + 1) // (2 * len(FAULTS)))
                  for i, kind in enumerate(FAULTS)]
        t_storm = time.monotonic()
        outcomes, struck, failed = asyncio.run(_storm(
            url, plans, args.concurrency, faults, kill, before,
            witness["choices"][0]["text"]))
        storm_s = time.monotonic() - t_storm
        with httpx.Client(base_url=url, timeout=120) as http:
            idle = wait_idle(http, fresh_check=True)
            after = http.post("/v1/completions", json=GREEDY_PROBE).json()["choices"][0]["text"]
            compare = _compare(url, args)
            last = wait_idle(http, fresh_check=True)
            compare["idle"] = tuple(last.get(k) for k in (
                "num_requests_running", "num_requests_waiting", "kv_cache_blocks_used",
                "kv_cache_integrity_ok"))
        drops = {k: v for k, v in outcomes.items() if k.startswith("drop")}
        report = {
            "clients": args.clients, "num_gpu_blocks": args.num_gpu_blocks,
            "storm_s": storm_s, "outcomes": dict(outcomes), "drops": sum(drops.values()),
            "failed": sum(failed.values()), "failed_kinds": dict(failed), "faults": struck,
            "recovered": len(struck) == len(FAULTS) and all(
                f["recovered_s"] is not None and f["same_text"] for f in struck),
            "witnesses_equal": all(f["witness_equal"] for f in struck),
            "preemptions": idle.get("num_preemptions_total", 0),
            "blocks_leaked": idle.get("kv_cache_blocks_used"),
            "running": idle.get("num_requests_running"),
            "waiting": idle.get("num_requests_waiting"),
            "kv_integrity_ok": idle.get("kv_cache_integrity_ok"),
            "same_text_after": after == before, "hostile_in_storm": sum(
                p.get("hostile", False) for p in plans), "compare": compare,
        }
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        client.shutdown()
    ok = (report["drops"] == 0 and report["failed"] == 0 and report["recovered"]
          and report["witnesses_equal"] and report["blocks_leaked"] == 0
          and report["running"] == 0 and report["waiting"] == 0
          and report["kv_integrity_ok"] == 1 and report["same_text_after"])
    c = report["compare"]
    ok = ok and (c["ratio"] <= args.max_ratio and c["good_failed"] == 0
                 and c["hostile_drops"] == 0 and not c["hostile_unexpected"]
                 and c["idle"] == (0, 0, 0, 1))
    print(json.dumps(report, indent=2))
    if args.out:
        _write(Path(args.out), report, " ".join(sys.argv[1:]), args)
    print("chaos: PASS" if ok else "chaos: FAIL")
    return 0 if ok else 1


def _write(path: Path, r: dict[str, Any], argv: str, args: argparse.Namespace) -> None:
    def fault_row(f: dict[str, Any]) -> str:
        back = "never" if f["recovered_s"] is None else f"{f['recovered_s']:.1f} s"
        return (f"| {f['kind']} actor | {back} | {f['in_flight']} | {f['failed']} | "
                f"{'equal' if f['witness_equal'] else 'DIFFERENT'} ({f['witness_chunks']} "
                "chunks) |")

    lines = [
        "## A chaos storm against the HTTP server", "",
        f"Command: `python benchmarks/scripts/chaos.py {argv}`", "",
        "The server of `pagedserve serve` (Ray controller actor and one worker actor, the demo",
        f"checkpoint, a {r['num_gpu_blocks']}-block KV pool; its preemptions are counted) takes",
        "a storm of clients:",
        "streaming and plain, clients leaving mid-stream or timing out, invalid parameters,",
        "prompts at the edge of the context, `n > 1`, shared prefixes, and "
        f"{r['hostile_in_storm']} hostile",
        "clients (`benchmarks/scripts/chaos_hostile.py`). Part-way through, the worker actor is",
        "killed, then the controller actor, then the new worker actor, each once the server",
        "serves again after the one before; a greedy witness stream runs across each kill.", "",
        "| measure | value |", "|---|---|",
        f"| clients | {r['clients']} (storm {r['storm_s']:.1f} s) |",
        *(f"| outcome `{k}` | {v} |" for k, v in sorted(r["outcomes"].items())),
        f"| drops (no complete answer, no typed error) | {r['drops']} |",
        f"| failed requests (no answer a well-run server gives) | {r['failed']} |",
        f"| kills / recoveries | {len(r['faults'])} / "
        f"{sum(f['recovered_s'] is not None for f in r['faults'])} |",
        f"| preemptions (since the last rebuild) | {r['preemptions']:.0f} |",
        f"| after the storm: running / waiting / KV blocks in use | {r['running']:.0f} / "
        f"{r['waiting']:.0f} / {r['blocks_leaked']:.0f} |",
        "| KV manager invariants when idle | "
        f"{'hold' if r['kv_integrity_ok'] == 1 else 'BROKEN'} |",
        f"| greedy text after = before | {r['same_text_after']} |", "",
        "| fault | kill to serving again | requests across the outage | failed | greedy "
        "witness vs an uninterrupted run |", "|---|---|---|---|---|",
        *(fault_row(f) for f in r["faults"]), "",
        "`left` counts the clients that hung up on purpose (their requests are aborted);",
        "`typed-error` counts OpenAI error bodies (400 for bad parameters or too long prompts)",
        "and SSE error events. A fault costs the requests in flight latency only: a worker's",
        "death pauses them while the controller rebuilds its worker group, a controller's while",
        "the front end starts a new one and resubmits them with their tokens so far.",
        *chaos_hostile.report_lines(r["compare"], args.concurrency, args.hostile,
                                    args.rounds, args.max_ratio),
    ]
    write_section(path, "chaos.py", lines, RESULTS_TITLE)


if __name__ == "__main__":
    sys.exit(main())
