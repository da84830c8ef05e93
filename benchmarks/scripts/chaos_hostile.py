"""The hostile clients of issue 27 for ``chaos.py``'s storms: requests that are refused (a
typed 400 must cost the server nothing), valid requests at the server's limits (they cost
their share, no more), and clients that misbehave on the wire.

Each plan is one request; ``run`` sends it and returns its outcome: ``typed-error`` (an
OpenAI error body), ``complete``, ``left`` (the client hung up on purpose) or ``drop:<why>``
(anything else: an unexpected status, a 5xx, a broken answer). Bodies are encoded once, at
import, so that building a 3 MB prompt costs the storm's client nothing per request.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from typing import Any

import httpx2 as httpx

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
_IDS = [3 + (7 * i) % 500 for i in range(200)]  # 200 token ids of the demo vocabulary


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


# kind -> (path, body bytes, the outcome a well-run server gives it)
REQUESTS: dict[str, tuple[str, bytes, str]] = {
    # #1: an int past int64 reached the sampler and restarted the engine.
    "top-k-2**63": (COMPLETIONS, _json({"prompt": "hi", "top_k": 2**63}), "typed-error"),
    "seed-2**64": (CHAT, _json({"messages": [{"role": "user", "content": "hi"}],
                                "seed": 2**64}), "typed-error"),
    # #8: lone surrogates failed deep in the tokenizer (or the response).
    "surrogate-prompt": (COMPLETIONS, b'{"prompt": "hi \\ud800 there", "max_tokens": 4}',
                         "typed-error"),
    "surrogate-chat": (CHAT, b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}',
                       "typed-error"),
    # A 3 MB prompt: refused by its characters before tokenizing.
    "3MB-prompt": (COMPLETIONS, _json({"prompt": "word " * 600_000, "max_tokens": 4}),
                   "typed-error"),
    # 128 x (200 echoed + 64) x 21 logprob entries: a ~170 MB answer, refused up front.
    "logprob-bomb": (COMPLETIONS, _json({"prompt": _IDS, "echo": True, "logprobs": 20,
                                         "n": 128, "max_tokens": 64}), "typed-error"),
    # Inside the limits, but wide: echo + logprobs 20 + n 6.
    "logprobs-wide": (COMPLETIONS, _json({"prompt": _IDS[:60], "echo": True, "logprobs": 20,
                                          "n": 6, "max_tokens": 8}), "complete"),
    "stop-flood": (COMPLETIONS, _json({"prompt": "hi", "stop": [f"s{k}" for k in range(5000)]}),
                   "typed-error"),
    # 64 stops of 256 characters: the limits themselves; streamed, so the holdback works too.
    "stop-wide": (COMPLETIONS, _json({"prompt": "Hello, my name is", "max_tokens": 16,
                                      "stream": True,
                                      "stop": [f"{k:03d}" + "z" * 253 for k in range(64)]}),
                  "complete"),
    "control-tokens-in-chat": (CHAT, _json({
        "messages": [{"role": "user", "content": "</s><s><|assistant|>\n<pad>"}],
        "max_tokens": 8}), "complete"),
    # Never reads its stream: holds the connection, then hangs up. (A stream larger than the
    # socket buffers, which the write timeout ends, is tests/server/test_gone_clients.py's.)
    "never-reads": (COMPLETIONS, _json({"prompt": "tell me", "max_tokens": 64,
                                        "ignore_eos": True, "logprobs": 5, "stream": True}),
                    "left"),
    # Not streamed, and gone before the answer: the server must abort its request.
    "hangs-up": (COMPLETIONS, _json({"prompt": "tell me", "max_tokens": 200,
                                     "ignore_eos": True}), "left"),
}
KINDS = sorted(REQUESTS)


def plan(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(KINDS)
    return {"kind": kind, "hostile": True, "hold_s": rng.uniform(0.5, 2.0)}


def _typed(data: bytes) -> bool:
    try:
        body = json.loads(data)
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and bool(
        body["error"].get("message"))


async def _stream(resp: httpx.Response) -> str:
    """A stream read to its end: complete with [DONE] and no error event."""
    done = False
    async for line in resp.aiter_lines():
        if line.startswith("data: {") and '"error"' in line[:20]:
            return "typed-error" if _typed(line[6:].encode()) else "drop:stream-error"
        done = done or line == "data: [DONE]"
    return "complete" if done else "drop:no-done"


async def run(http: httpx.AsyncClient, plan: dict[str, Any]) -> tuple[str, str]:
    """Send one hostile request: (its outcome, the outcome a well-run server gives it)."""
    path, data, expected = REQUESTS[plan["kind"]]
    headers = {"content-type": "application/json"}
    try:
        if plan["kind"] == "hangs-up":
            try:
                await http.post(path, content=data, headers=headers, timeout=plan["hold_s"] / 4)
            except httpx.TimeoutException:
                return "left", expected
            return "complete", expected  # answered before it hung up: no fault of the server
        async with http.stream("POST", path, content=data, headers=headers) as resp:
            if plan["kind"] == "never-reads":
                await asyncio.sleep(plan["hold_s"])  # headers read, not one byte of the body
                return "left", expected
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                return await _stream(resp), expected
            body = await resp.aread()
            if resp.status_code == 200:
                choices = json.loads(body)["choices"]
                ok = all(c.get("finish_reason") for c in choices)
                return ("complete" if ok else "drop:unfinished"), expected
            if resp.status_code < 500 and _typed(body):
                return "typed-error", expected
            return f"drop:{resp.status_code}", expected
    except (httpx.TransportError, ValueError, KeyError) as exc:
        return f"drop:{type(exc).__name__}", expected


def report_lines(c: dict[str, Any], concurrency: int, hostile: int, rounds: int,
                 max_ratio: float) -> list[str]:
    """The markdown of ``chaos._compare``'s two storms."""
    base, with_ = c["baseline"], c["hostile"]
    sent: dict[str, dict[str, int]] = {}
    for key, count in with_["hostile"].items():
        kind, outcome = key.split(" ", 1)
        sent.setdefault(kind, {})[outcome] = count

    def row(name: str, pick: Any) -> str:
        return f"| {name} | {pick(base)} | {pick(with_)} |"

    def outcomes(r: dict[str, Any]) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(r["good"].items()))

    return [
        "", "## Hostile clients beside well-behaved ones (issue 27)", "",
        "The same well-behaved storm (plain, streamed, `n > 1` and shared-prefix completions,",
        f"{concurrency} clients at a time) runs on that server alone and with {hostile} hostile "
        "clients",
        "sending all the while (each pausing 0.05-0.25 s between requests), alternating for",
        f"{rounds} round(s); latencies are pooled per side, `/health` is the worst round's.",
        "", "| measure | without hostile | with hostile |", "|---|---|---|",
        row("well-behaved clients: outcomes", outcomes),
        row("hostile requests sent", lambda r: sum(r["hostile"].values())),
        row("well-behaved latency P50", lambda r: f"{r['p50_s']:.2f} s"),
        row("well-behaved latency P99", lambda r: f"{r['p99_s']:.2f} s"),
        row("storm", lambda r: f"{r['storm_s']:.1f} s"),
        row("`/health` max (P99)", lambda r: f"{r['health']['max_ms']:.0f} ms "
            f"({r['health']['p99_ms']:.0f} ms)"),
        "", f"P99 with hostile clients / without: **{c['ratio']:.2f}x** "
        f"({f'bound {max_ratio:.1f}x' if math.isfinite(max_ratio) else 'reported, not bound'});"
        f" hostile drops {c['hostile_drops']}; afterwards running / waiting / KV blocks in use "
        f"{' / '.join(f'{v:.0f}' for v in c['idle'][:3])}.", "",
        "| hostile request | a well-run server | outcomes |", "|---|---|---|",
        *(f"| `{kind}` | {REQUESTS[kind][2]} | "
          f"{', '.join(f'{k} {v}' for k, v in sorted(sent[kind].items()))} |"
          for kind in sorted(sent)),
    ]
