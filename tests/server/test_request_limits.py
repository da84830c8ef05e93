"""``ServerLimits``: each limit refuses, with a 400 naming the parameter and the flag, what is
over it and passes what is not; the ``serve`` flags fill it (0: no limit)."""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from types import SimpleNamespace

import httpx2 as httpx
import pytest

from pagedserve.serving.cli.limit_args import limits_from_args
from pagedserve.serving.cli.serve import add_serve_parser
from pagedserve.serving.openai.limits import ServerLimits
from pagedserve.serving.openai.render import render_json
from pagedserve.serving.openai.server import build_app

LIMITS = ServerLimits(max_prompt_chars=1000, max_stop_strings=4, max_stop_chars=8,
                      max_logprob_entries=5000)


@pytest.fixture(scope="module")
def env(llama_dir, srv) -> Iterator[SimpleNamespace]:
    client = srv.start_client(llama_dir)
    try:
        with srv.running(build_app(client, limits=LIMITS)) as url, \
                httpx.Client(base_url=url, timeout=60) as http:
            yield SimpleNamespace(http=http, client=client)
    finally:
        client.shutdown()


def _refused(resp: httpx.Response, param: str, flag: str) -> None:
    assert resp.status_code == 400, resp.text[:300]
    err = resp.json()["error"]
    assert (err["param"], err["code"]) == (param, "request_too_large"), err
    assert flag in err["message"], err


def test_prompt_characters_are_counted_before_tokenizing(env) -> None:
    post = env.http.post
    _refused(post("/v1/completions", json={"prompt": "x" * 1001}), "prompt", "--max-prompt-chars")
    _refused(post("/v1/completions", json={"prompt": ["ok", "y" * 1001]}), "prompt",
             "--max-prompt-chars")
    _refused(post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "z" * 600}] * 2}), "messages",
        "--max-prompt-chars")
    _refused(post("/tokenize", json={"prompt": "x" * 1001}), "prompt", "--max-prompt-chars")
    assert post("/tokenize", json={"prompt": "x" * 1000}).json()["count"] > 0
    assert post("/v1/completions", json={"prompt": "x" * 200, "max_tokens": 1}).status_code == 200


def test_stop_strings_are_bounded_in_number_and_length(env) -> None:
    post = env.http.post
    base = {"prompt": "Hello", "max_tokens": 2}
    _refused(post("/v1/completions", json={**base, "stop": ["a", "b", "c", "d", "e"]}), "stop",
             "--max-stop-strings")
    _refused(post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "stop": "123456789"}), "stop",
        "--max-stop-chars")
    assert post("/v1/completions", json={**base, "stop": ["a", "b", "12345678"]}).status_code == 200


def test_ten_thousand_stop_strings_are_refused_by_default(env, srv) -> None:
    """#27 row 6: 10,000 stop strings with n 128 slowed every client for a minute."""
    app = build_app(env.client)
    with srv.running(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        out = http.post("/v1/completions", json={
            "prompt": "Hello", "n": 16, "max_tokens": 4,
            "stop": [f"stop{i}" for i in range(10_000)]})
    _refused(out, "stop", "--max-stop-strings")


def test_logprob_entries_of_an_answer_are_bounded(env) -> None:
    post = env.http.post
    ids = list(range(3, 103))  # 100 prompt tokens
    # echo: n 4 x (100 + 0) x (1 + 20) = 8400 > 5000
    _refused(post("/v1/completions", json={
        "prompt": ids, "echo": True, "logprobs": 20, "max_tokens": 0, "n": 4}),
        "logprobs", "--max-logprob-entries")
    # 2 x (100 + 10) x 21 = 4620: within
    out = post("/v1/completions", json={
        "prompt": ids, "echo": True, "logprobs": 20, "max_tokens": 10, "n": 2,
        "ignore_eos": True})
    assert out.status_code == 200, out.text
    assert len(out.json()["choices"][0]["logprobs"]["tokens"]) == 110
    # chat without max_tokens may run to the context's end: n 2 x (256 - prompt) x 21 > 5000
    _refused(post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20,
        "n": 2}),
        "logprobs", "--max-logprob-entries")
    # without logprobs the product does not apply
    assert post("/v1/completions", json={"prompt": ids, "echo": True, "max_tokens": 0, "n": 4}
                ).status_code == 200


def _serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *flags])


def test_flags_fill_the_limits_and_zero_means_none() -> None:
    assert limits_from_args(_serve_args()) == ServerLimits()
    limits = limits_from_args(_serve_args(
        "--max-body-bytes", "1024", "--max-prompt-chars", "0", "--max-stop-strings", "9",
        "--max-stop-chars", "3", "--max-logprob-entries", "0", "--header-timeout", "2.5",
        "--body-timeout", "0", "--write-timeout", "7", "--cpu-workers", "3"))
    assert limits == ServerLimits(
        max_body_bytes=1024, max_prompt_chars=None, max_stop_strings=9, max_stop_chars=3,
        max_logprob_entries=None, header_timeout_s=2.5, body_timeout_s=None,
        write_timeout_s=7.0, cpu_workers=3)
    with pytest.raises(ValueError, match="--write-timeout"):
        limits_from_args(_serve_args("--write-timeout", "-1"))
    with pytest.raises(ValueError, match="cpu_workers"):
        limits_from_args(_serve_args("--cpu-workers", "0"))


def test_the_prompt_limit_follows_the_context_by_default() -> None:
    assert ServerLimits().prompt_chars_for(8192) == 32 * 8192
    assert ServerLimits(max_prompt_chars=10).prompt_chars_for(8192) == 10
    with pytest.raises(ValueError, match="max_stop_chars"):
        ServerLimits(max_stop_chars=0)


def test_answers_render_as_json_dumps_renders_them() -> None:
    rng = random.Random(27)

    def value(depth: int):
        kind = rng.random()
        if depth > 1 or kind < 0.3:
            return rng.choice([0, -1.5, 1e300, "é\"\\\n😀", None, True, [], {}])
        if kind < 0.65:  # long lists (rendered in slices) at both levels, of scalars or not
            size = rng.choice([0, 2, 300, 600]) if depth == 0 else rng.choice([0, 3, 3, 260])
            return [value(depth + 1) for _ in range(size)]
        return {f"k{i}\u00fc": value(depth + 1) for i in range(rng.randint(0, 4))}

    for _ in range(60):
        obj = value(0)
        assert render_json(obj) == json.dumps(
            obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    with pytest.raises(ValueError):
        render_json([float("nan")] * 300)
    assert render_json([float("nan")], allow_nan=True) == b"[NaN]"
