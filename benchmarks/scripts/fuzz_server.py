"""Fuzz the live HTTP server: hypothesis request bodies for the two completion endpoints.

Every numeric field of ``CompletionRequest`` and ``ChatCompletionRequest`` (read from their
JSON schema, so a new field is fuzzed without touching this file) is walked at its bounds, just
past them, at huge ints (2**63, 2**64, 10**30), negatives, NaN and infinities (Python's JSON
parser takes ``NaN``/``Infinity``, so a client can send them) and the wrong types; text fields
get lone surrogates (as JSON escapes, and as raw bytes that are not UTF-8), control-token text
(``</s>``, ``<|assistant|>``), prompts past the character limit and unknown fields; chat gets
odd roles and content parts. Each body goes to a real uvicorn server over the in-process
engine (the demo checkpoint), while a thread probes ``/health`` every 20 ms.

Checks: no answer >= 500 (nor a stream's internal-error event, nor a dropped connection), no
engine restart, ``/health`` answering 200 throughout (its slowest answer is reported), and
afterwards 0 running requests and 0 KV blocks in use. Exit status 1 when any fails.

    python benchmarks/scripts/fuzz_server.py --examples 400 --out docs/results/reliability.md
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import tempfile
import time
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx2 as httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from pagedserve.serving.openai.protocol import ChatCompletionRequest, CompletionRequest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, when imported
from chaos_common import RESULTS_TITLE, HealthProbe, ProbeProcess, serve, wait_idle  # noqa: E402
from results_section import write_section  # noqa: E402

MAX_MODEL_LEN = 128
INT32_MAX = 2**31 - 1
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# Past any bound, and past int64 / float64 where a value would reach C (numpy, torch).
HUGE = [2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30), 2**1024]
ODD_NUMBERS = [math.nan, math.inf, -math.inf, -0.0, 5e-324, 1e308, 1.5, -1.5]
WRONG_TYPES = ["1", "", True, None, [], {}, [1]]
# Valid text the chat template and the tokenizer must take as text (never as control tokens).
SPECIAL_TEXT = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>\n", "<|system|>",
                "<|endoftext|>", "{{ bos_token }}", "{% endfor %}", "\x00", "\U0001f600",
                "\u202e", "\ufeff", "\r\n\r\n"]
BAD_TEXT = ["\ud800", "\udfff", "\ud83d", "a\udc00b", "a" * 5000, "a " * 3000]
# In-range values that would only make a run slow on 2 cores (128 sequences, 2**31 tokens):
# clamped. A value outside the bounds is never touched; the bounds themselves have their own
# test (tests/server/test_request_bounds.py).
CHEAP = {"n": 4, "best_of": 4, "max_tokens": 16, "max_completion_tokens": 16, "min_tokens": 16}
Strategies = dict[str, st.SearchStrategy[Any]]
ROLES = ["user", "system", "assistant", "tool", "developer"]  # the demo template's


# ------------------------------------------------------------------------------ strategies
# Each builder takes ``hostile``: False gives values the server must serve (200), True values
# anywhere (a 4xx is fine, a 5xx never). A body is all valid, valid but one hostile field, or
# hostile throughout; valid bodies reach the engine, so the paths past validation are fuzzed.


def _text(hostile: bool) -> st.SearchStrategy[str]:
    special = st.lists(st.sampled_from(SPECIAL_TEXT), min_size=1, max_size=4).map("".join)
    if not hostile:
        return st.one_of(st.text(max_size=24), special)
    char = st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr))
    return st.one_of(st.text(char, max_size=24), special, st.sampled_from(BAD_TEXT))


def _json() -> st.SearchStrategy[Any]:
    leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), _text(True),
                     st.sampled_from(HUGE))
    return st.recursive(leaf, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(_text(True), inner, max_size=3)),
        max_leaves=6)


def _number(node: dict[str, Any], hostile: bool) -> st.SearchStrategy[Any]:
    """One numeric field's values: in range; hostile: also at and past each bound, huge,
    NaN and infinities, and the wrong types."""
    lo_open = "exclusiveMinimum" in node
    lo = node.get("exclusiveMinimum", node.get("minimum", -INT32_MAX))
    hi = node.get("maximum", INT32_MAX)
    if node["type"] == "integer":
        edges = [lo, lo - 1, hi, hi + 1, lo + lo_open]
        inside = st.integers(int(lo) + lo_open, int(hi))
    else:
        edges = [lo, math.nextafter(lo, -math.inf), math.nextafter(lo, math.inf), hi,
                 math.nextafter(hi, math.inf)]
        inside = st.floats(lo, hi, exclude_min=lo_open)
    if not hostile:
        return inside
    return st.one_of(st.sampled_from(edges), st.sampled_from(HUGE + ODD_NUMBERS), inside,
                     st.sampled_from(WRONG_TYPES))


def _field(prop: dict[str, Any], hostile: bool) -> st.SearchStrategy[Any] | None:
    """Values of one property with numbers in it (in a list, a dict's values), else None."""
    options = []
    for option in prop.get("anyOf", [prop]):
        depth, node = 0, option
        while node.get("type") == "array":
            depth, node = depth + 1, node["items"]
        if node.get("type") == "object" and isinstance(node.get("additionalProperties"), dict):
            node, depth = node["additionalProperties"], -1
        if node.get("type") not in ("integer", "number"):
            continue
        values = _number(node, hostile)
        if depth == -1:  # logit_bias: token-id keys, in and out of the vocabulary
            keys = st.one_of(st.sampled_from(["0", "5", "-1", "511", "512", str(2**63), "abc",
                                              "", "1.5", " 7", "\ud800"]), _text(True))
            values = st.dictionaries(keys, values, max_size=4)
        for _ in range(max(depth, 0)):
            values = st.lists(values, max_size=5)
        options.append(values)
    return st.one_of(*options) if options else None


def _fields(model: type, hostile: bool) -> Strategies:
    """Every optional field of ``model``: the numbers by their schema, the rest by hand."""
    out = {name: strategy for name, prop in model.model_json_schema()["properties"].items()
           if name not in ("prompt", "messages")
           and (strategy := _field(prop, hostile)) is not None}
    text = _text(hostile)
    out |= {"stop": st.one_of(text, st.lists(text, max_size=4)), "stream": st.booleans(),
            "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
            "user": text, "cache_salt": text, "ignore_eos": st.booleans(),
            "skip_special_tokens": st.booleans(), "echo": st.booleans()}
    if not hostile:  # the server's own refusals (vocabulary, logit_bias, best_of) are hostile
        out |= {"stop_token_ids": st.lists(st.integers(3, 511), max_size=3),
                "logit_bias": st.just({}), "best_of": st.none()}
    else:
        wrong = st.sampled_from(WRONG_TYPES)
        out |= {"stop": st.one_of(out["stop"], wrong, st.just(["x"] * 2000),
                                  st.just(["y" * 300]), st.just(["", ""])),
                "stream": st.one_of(st.booleans(), wrong), "stream_options": _json(),
                "model": st.one_of(st.sampled_from(["", "\ud800"]), text),
                "suffix": text, "echo": st.one_of(st.booleans(), wrong),
                "tools": st.one_of(st.lists(_json(), max_size=2), _json())}
    return {k: v for k, v in out.items() if k in model.model_fields}


def _prompt(hostile: bool) -> st.SearchStrategy[Any]:
    if not hostile:
        ids = st.integers(3, 511)
        return st.one_of(_text(False).filter(bool), st.lists(ids, min_size=1, max_size=12),
                         st.lists(_text(False).filter(bool), min_size=1, max_size=3),
                         st.lists(st.lists(ids, min_size=1, max_size=6), min_size=1, max_size=3))
    ids = st.one_of(st.integers(0, 600), st.integers(), st.sampled_from(HUGE + ODD_NUMBERS))
    return st.one_of(
        _text(True), st.lists(ids, max_size=12), st.lists(_text(True), max_size=3),
        st.lists(st.lists(ids, max_size=6), max_size=3), st.just(list(range(3, 3 + 200))),
        st.sampled_from(["", [], [[]], [1, "a"], None, 5, {"text": "hi"}]))


def _messages(hostile: bool) -> st.SearchStrategy[Any]:
    roles: st.SearchStrategy[Any] = st.sampled_from(ROLES)
    text = _text(hostile)
    part_type, content = st.just("text"), st.one_of(text, st.none())
    if hostile:  # a role the template does not know is a 400
        roles = st.one_of(roles, st.sampled_from(["function", "", "USER", "<|user|>", "r" * 300]),
                          text, st.sampled_from(WRONG_TYPES))
        part_type = st.sampled_from(["text", "image_url", "input_audio", "", 5])
        content = st.one_of(content, st.sampled_from(WRONG_TYPES[:2] + [7, {"text": "hi"}]))
    part = st.fixed_dictionaries({"type": part_type, "text": text})
    message = st.fixed_dictionaries({"role": roles}, optional={
        "content": st.one_of(content, st.lists(part, max_size=3)), "name": text})
    if not hostile:
        return st.lists(message, min_size=1, max_size=3)
    extra = st.fixed_dictionaries({}, optional={"tool_calls": _json(), "image_url": _json()})
    message = st.builds(lambda m, e: {**e, **m}, message, extra)
    return st.one_of(st.lists(st.one_of(message, _json()), max_size=4), _json())


NON_OBJECTS = [[], "x", None, 1, [{"prompt": "hi"}]]
DEEP = b"[" * 100_000 + b"]" * 100_000  # json.loads recurses: must be a 400, not a crash


def _cheap(body: Any) -> Any:
    if isinstance(body, dict):
        for name, cap in CHEAP.items():
            value = body.get(name)
            if type(value) is int and 0 < value < INT32_MAX:
                body[name] = min(value, cap)
    return body


def _encode(body: Any, how: str) -> bytes:
    """``ascii``: lone surrogates as JSON escapes (valid JSON); ``raw``: as the bytes
    surrogatepass gives (not UTF-8); ``garbage``: bytes that are not UTF-8 in the middle."""
    if how == "ascii":
        return json.dumps(body).encode()
    data = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    half = len(data) // 2
    return data if how == "raw" else data[:half] + b"\xff\xfe\xc3" + data[half:]


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, bytes, str, Any]:
    """(path, shape, body bytes, content type, the decoded body or None)."""
    path = draw(st.sampled_from([COMPLETIONS, CHAT]))
    model, required = ((CompletionRequest, "prompt") if path == COMPLETIONS
                       else (ChatCompletionRequest, "messages"))
    shape = draw(st.sampled_from(["valid"] * 3 + ["one-hostile"] * 4 + ["hostile"] * 3
                                 + ["non-object", "deep", "bytes"]))
    if shape == "deep":
        return path, shape, DEEP, "application/json", None
    if shape == "non-object":
        return path, shape, json.dumps(draw(st.sampled_from(NON_OBJECTS))).encode(), \
            "application/json", None
    builders = {"prompt": _prompt, "messages": _messages}
    hostile = shape == "hostile"
    optional = _fields(model, hostile)
    body: Any = draw(st.fixed_dictionaries({required: builders[required](hostile)},
                                           optional=optional))
    if not hostile and body.get("top_logprobs") is not None:
        body["logprobs"] = True  # a valid body asks for them as the field needs
    if shape == "one-hostile":
        name = draw(st.sampled_from(sorted([*optional, required])))
        hostile_fields = {**_fields(model, True), required: builders[required](True)}
        body[name] = draw(hostile_fields[name])
    # Unknown fields are ignored; their names and values may be anything.
    body = _cheap({**draw(st.dictionaries(_text(True), _json(), max_size=2)), **body})
    how = "ascii" if shape != "bytes" else draw(st.sampled_from(["raw", "garbage"]))
    kind = "application/json" if shape == "valid" else draw(
        st.sampled_from(["application/json"] * 9 + ["text/plain"]))
    return path, shape, _encode(body, how), kind, body


# --------------------------------------------------------------------------------- the run


def _post(http: httpx.Client, path: str, data: bytes, kind: str, body: Any) -> str:
    """One request; its outcome: the status, ``stream-internal-error`` (an SSE error event of
    type server_error: a 500 after the 200), or the transport error. Streams are read out."""
    headers = {"content-type": kind}
    try:
        if not (isinstance(body, dict) and body.get("stream") is True):
            return str(http.post(path, content=data, headers=headers).status_code)
        with http.stream("POST", path, content=data, headers=headers) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {") and '"server_error"' in line:
                    return "stream-internal-error"
            return str(resp.status_code)
    except httpx.TransportError as exc:
        return f"transport:{type(exc).__name__}"


def _bad(outcome: str) -> bool:
    return outcome[0] not in "1234"


def fuzz(url: str, *, examples: int, seed: int, probe_process: bool = True) -> dict[str, Any]:
    """Post ``examples`` hypothesis bodies (a fixed ``seed``: the same bodies every run) to
    the server at ``url`` while probing /health (from a process of its own unless not
    ``probe_process``); then wait until the server is idle. Returns the report."""
    outcomes: Counter[str] = Counter()
    per_shape: Counter[str] = Counter()
    bad: list[str] = []
    spans: list[tuple[float, float, str]] = []  # each request's time, to explain a slow probe
    probe = ProbeProcess(url) if probe_process else HealthProbe(url)
    t0 = time.monotonic()
    probe.start()
    with httpx.Client(base_url=url, timeout=120) as http:

        @hypothesis_seed(seed)
        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(requests())
        def one(request: tuple[str, str, bytes, str, Any]) -> None:
            path, shape, data, kind, body = request
            start = time.perf_counter()
            outcome = _post(http, path, data, kind, body)
            spans.append((start, time.perf_counter(), f"{outcome} {path} {data[:120]!r}"))
            outcomes[outcome] += 1
            per_shape[f"{shape} {outcome}"] += 1
            if _bad(outcome):
                bad.append(f"{outcome} {path} {data[:300]!r}")

        one()
        fuzz_s = time.monotonic() - t0
        idle = wait_idle(http)  # aborted and finished requests all freed
    health = probe.stop()
    at, took = probe.slowest
    health["slowest_during"] = [d for a, b, d in spans if a < at + took and b > at]
    return {"examples": sum(outcomes.values()), "seed": seed, "fuzz_s": fuzz_s,
            "outcomes": dict(sorted(outcomes.items())),
            "per_shape": dict(sorted(per_shape.items())), "bad": bad,
            "server_errors": sum(v for k, v in outcomes.items() if _bad(k)), "health": health,
            "running": idle.get("num_requests_running"),
            "waiting": idle.get("num_requests_waiting"),
            "blocks_used": idle.get("kv_cache_blocks_used")}


def passed(r: dict[str, Any], health_bound_ms: float) -> bool:
    return (r["server_errors"] == 0 and r["restarts"] == 0 and not r["health"]["failures"]
            and r["health"]["max_ms"] < health_bound_ms and r["running"] == 0
            and r["blocks_used"] == 0)


def _server(conn: Connection) -> None:
    """The server, in a process of its own as ``pagedserve serve`` runs it: in the fuzzer's
    process, hypothesis' own Python work (and its garbage collections) would hold the GIL
    and count against /health. Sends its URL; at any message, its engine's restarts."""
    from pagedserve.builder import start_engine
    from pagedserve.config import from_flat
    from pagedserve.serving.openai.limits import ServerLimits
    from pagedserve.serving.openai.server import build_app
    from pagedserve.workers.demo import write_demo_checkpoint

    model = write_demo_checkpoint(Path(tempfile.mkdtemp(prefix="pagedserve-fuzz-")) / "demo")
    client: Any = start_engine(from_flat(model=str(model), dtype="float32",
                                         max_model_len=MAX_MODEL_LEN,
                                         kv_cache_memory_bytes=1 << 22), "local")
    server, thread, url = serve(build_app(client, limits=ServerLimits()), ServerLimits())
    conn.send(url)
    conn.recv()
    conn.send(client.engine.num_restarts)
    server.should_exit = True
    thread.join(timeout=15)
    client.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--examples", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--health-bound-ms", type=float, default=100.0)
    ap.add_argument("--out", default=None, help="write the report here (its section of the file)")
    args = ap.parse_args()
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    proc = multiprocessing.get_context("spawn").Process(target=_server, args=(theirs,))
    proc.start()
    try:
        report = fuzz(ours.recv(), examples=args.examples, seed=args.seed)
        ours.send("stop")
        report["restarts"] = ours.recv()
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    ok = passed(report, args.health_bound_ms)
    print(json.dumps(report, indent=2))
    if args.out:
        _write(Path(args.out), report, " ".join(sys.argv[1:]), args.health_bound_ms)
    print("fuzz: PASS" if ok else "fuzz: FAIL")
    return 0 if ok else 1


def _write(path: Path, r: dict[str, Any], argv: str, bound_ms: float) -> None:
    h = r["health"]
    write_section(path, "fuzz_server.py", [
        "### Live-server fuzz: the figures", "",
        f"Command: `python benchmarks/scripts/fuzz_server.py {argv}`", "",
        "| measure | value |", "|---|---|",
        f"| requests | {r['examples']} ({r['fuzz_s']:.1f} s, hypothesis seed {r['seed']}) |",
        *(f"| body shape, status `{k}` | {v} |" for k, v in r["per_shape"].items()),
        f"| answers >= 500, stream internal errors, dropped connections | {r['server_errors']} |",
        f"| engine restarts | {r['restarts']} |",
        f"| `/health` probes (every 20 ms) / not 200 | {h['probes']} / "
        f"{sum(h['failures'].values())} |",
        f"| `/health` latency median / p99 / max | {h['median_ms']:.1f} / {h['p99_ms']:.1f} / "
        f"{h['max_ms']:.1f} ms (bound {bound_ms:.0f} ms) |",
        f"| after: running / waiting / KV blocks in use | {r['running']:.0f} / "
        f"{r['waiting']:.0f} / {r['blocks_used']:.0f} |"], RESULTS_TITLE)


if __name__ == "__main__":
    sys.exit(main())
