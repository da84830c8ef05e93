"""Schema conformance: sampled JSON under ``response_format`` json_schema, checked with
``jsonschema``.

Each schema of ``data/schemas.json`` (nested objects, arrays with minItems/maxItems, enums,
``pattern``, numbers with minimum/maximum, ``anyOf``, required and optional properties) is
asked for through ``/v1/chat/completions`` at temperature 1, with n = 1 and n = 4, streamed
and not, on SmolLM2-135M-Instruct (the default model) behind an in-process server, or on a
server at ``--url``. Every choice must parse as JSON that the schema validates. A choice whose
``max_tokens`` ran short ends with ``finish_reason`` length: it counts as valid if the server
closed the document in its last tokens (the table counts these apart), and as invalid if the
document was cut off. The target is 100%; the exit status is 1 below ``--min-valid``.

    python benchmarks/scripts/schema_conformance.py                 # all schemas, 4 modes
    python benchmarks/scripts/schema_conformance.py --limit 4 --n 1 --max-tokens 96
    python benchmarks/scripts/schema_conformance.py --url http://127.0.0.1:8000 --model m
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx
import jsonschema

SCHEMAS = Path(__file__).resolve().parent / "data" / "schemas.json"
SYSTEM = "You are a helpful assistant. Answer with JSON only."


@dataclass(slots=True)
class Outcome:
    """One choice of one request."""

    schema: str
    mode: str
    valid: bool
    why: str = ""
    text: str = ""


def load_schemas(path: Path, only: list[str] | None, limit: int | None) -> list[dict[str, Any]]:
    entries = json.loads(path.read_text())
    if only:
        entries = [e for e in entries if e["name"] in only]
    return entries[:limit] if limit else entries


def check(text: str, finish: str | None, schema: dict[str, Any]) -> tuple[bool, str]:
    """(valid, why not) for one choice."""
    if finish not in ("stop", "length"):
        return False, f"finish_reason {finish}"
    try:
        value = json.loads(text)
    except ValueError as exc:
        return False, "cut off by max_tokens" if finish == "length" else f"not JSON: {exc}"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        return False, f"schema: {exc.message}"
    return True, "closed by max_tokens" if finish == "length" else ""


def _body(entry: dict[str, Any], args: argparse.Namespace, n: int, seed: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": args.model_name, "n": n, "temperature": args.temperature, "seed": seed,
        "max_tokens": args.max_tokens,
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": entry["prompt"]}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": entry["name"], "schema": entry["schema"]}},
    }
    if args.compact:
        body["structured_outputs"] = {"disable_any_whitespace": True}
    return body


def _streamed(http: httpx.Client, body: dict[str, Any]) -> list[tuple[str, str | None]]:
    """(text, finish_reason) per choice, gathered from the server-sent events."""
    texts: dict[int, list[str]] = {}
    finish: dict[int, str | None] = {}
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                i = choice["index"]
                texts.setdefault(i, []).append(choice["delta"].get("content") or "")
                if choice.get("finish_reason"):
                    finish[i] = choice["finish_reason"]
    return [("".join(texts[i]), finish.get(i)) for i in sorted(texts)]


def _whole(http: httpx.Client, body: dict[str, Any]) -> list[tuple[str, str | None]]:
    resp = http.post("/v1/chat/completions", json=body)
    resp.raise_for_status()
    return [(c["message"]["content"] or "", c["finish_reason"])
            for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]


def run(url: str, schemas: list[dict[str, Any]], args: argparse.Namespace) -> list[Outcome]:
    """Every schema in every mode, ``args.concurrency`` requests at a time."""
    modes = [(n, stream) for n in args.n for stream in args.stream]
    jobs = [(i, e, n, stream) for i, e in enumerate(schemas) for n, stream in modes]

    def one(job: tuple[int, dict[str, Any], int, bool]) -> list[Outcome]:
        i, entry, n, stream = job
        mode = f"n={n} {'stream' if stream else 'whole'}"
        body = _body(entry, args, n, args.seed + 1000 * i + 10 * n + stream)
        try:
            choices = (_streamed if stream else _whole)(http, body)
        except httpx.HTTPError as exc:
            return [Outcome(entry["name"], mode, False, f"request failed: {exc}")]
        if len(choices) != n:
            return [Outcome(entry["name"], mode, False, f"{len(choices)} choices, not {n}")]
        return [Outcome(entry["name"], mode, *check(text, finish, entry["schema"]), text)
                for text, finish in choices]

    with httpx.Client(base_url=url, timeout=args.timeout) as http, \
            ThreadPoolExecutor(args.concurrency) as pool:
        return [o for outs in pool.map(one, jobs) for o in outs]


def report(outcomes: list[Outcome]) -> float:
    """Print the table and the failures; the overall share of valid choices."""
    by_mode: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_mode.setdefault(o.mode, []).append(o)
    # Ended by max_tokens apart from the rest: closed by the server (valid) or cut off.
    print("| mode | choices | valid | valid % | of them closed by max_tokens "
          "| cut off by max_tokens | other invalid |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, outs in [*by_mode.items(), ("all", outcomes)]:
        ok = sum(o.valid for o in outs)
        closed = sum(o.why == "closed by max_tokens" for o in outs)
        cut = sum(o.why == "cut off by max_tokens" for o in outs)
        share = ok / len(outs) if outs else 0.0
        print(f"| {mode} | {len(outs)} | {ok} | {100 * share:.1f}% | {closed} | {cut} | "
              f"{len(outs) - ok - cut} |")
    for o in outcomes:
        if not o.valid:
            print(f"INVALID {o.schema} ({o.mode}): {o.why}; text {o.text[:120]!r}")
        elif o.why:
            print(f"CLOSED {o.schema} ({o.mode}): ends {o.text[-80:]!r}")
    return sum(o.valid for o in outcomes) / len(outcomes) if outcomes else 0.0


@contextmanager
def local_server(args: argparse.Namespace) -> Iterator[str]:
    """The default model (or ``--model``) behind the HTTP server, in this process."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module
    from chaos_common import serve

    from pagedserve.builder import resolve_model_dir, start_engine
    from pagedserve.config import from_flat
    from pagedserve.serving.openai.server import build_app

    model = args.model or str(resolve_model_dir(None))
    start = time.monotonic()
    client = start_engine(from_flat(model=model, dtype=args.dtype,
                                    max_model_len=args.max_model_len), "local")
    app = build_app(client)
    server, thread, url = serve(app)
    args.model_name = client.model_name
    print(f"engine and server ready in {time.monotonic() - start:.1f}s", flush=True)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        app.state.context.pool.close()
        client.shutdown()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: SmolLM2)")
    p.add_argument("--url", default=None, help="a running server instead of an in-process one")
    p.add_argument("--schemas", type=Path, default=SCHEMAS)
    p.add_argument("--only", nargs="*", help="schema names to run")
    p.add_argument("--limit", type=int, default=None, help="the first K schemas only")
    p.add_argument("--n", type=int, nargs="+", default=[1, 4])
    p.add_argument("--stream", choices=["both", "on", "off"], default="both")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compact", action="store_true",
                   help="only ', ' and ': ' between JSON tokens (structured_outputs."
                        "disable_any_whitespace)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--min-valid", type=float, default=1.0,
                   help="exit 1 when the valid share is below this (0..1)")
    args = p.parse_args(argv)
    args.stream = {"both": [False, True], "on": [True], "off": [False]}[args.stream]
    args.model_name = args.model
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    schemas = load_schemas(args.schemas, args.only, args.limit)
    if args.url:
        start = time.monotonic()
        outcomes = run(args.url, schemas, args)
    else:
        with local_server(args) as url:
            start = time.monotonic()
            outcomes = run(url, schemas, args)
    print(f"{len(schemas)} schemas, modes n={args.n} stream={args.stream}, "
          f"temperature {args.temperature}, {time.monotonic() - start:.1f}s")
    share = report(outcomes)
    if share < args.min_valid:
        print(f"FAIL: {100 * share:.1f}% valid, below --min-valid {100 * args.min_valid:.1f}%")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
