"""Concurrent streams, client disconnects and the Prometheus endpoint (prefix caching off, so
``kv_blocks_used`` returns to 0 once nothing runs)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from types import SimpleNamespace

import httpx2 as httpx
import pytest

from pagedserve.serving.openai.server import build_app


@pytest.fixture(scope="module")
def env(llama_dir, srv) -> Iterator[SimpleNamespace]:
    client = srv.start_client(llama_dir, enable_prefix_caching=False, max_model_len=512)
    try:
        with srv.running(build_app(client)) as url, httpx.Client(base_url=url, timeout=60) as h:
            yield SimpleNamespace(client=client, http=h, url=url, srv=srv)
    finally:
        client.shutdown()


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = rf"^{re.escape(name)}{re.escape(labels)} (\S+)$"
    m = re.search(pattern, text, re.MULTILINE)
    assert m is not None, f"{name}{labels} missing from /metrics"
    return float(m.group(1))


def _idle(client) -> bool:
    s = client.stats()
    return s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_blocks_used"] == 0


def test_eight_concurrent_streams_complete_correctly(env) -> None:
    prompts = [f"Hello, world! Story number {i} about the sea." for i in range(8)]

    def body(p: str, stream: bool) -> dict:
        return {"prompt": p, "max_tokens": 16 + 2 * prompts.index(p), "temperature": 0.0,
                "ignore_eos": True, "stream": stream}

    async def one_stream(http: httpx.AsyncClient, p: str) -> tuple[str, list[str | None]]:
        text, finishes = "", []
        async with http.stream("POST", "/v1/completions", json=body(p, True)) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                finishes.append(choice["finish_reason"])
        return text, finishes

    async def all_streams() -> list[tuple[str, list[str | None]]]:
        async with httpx.AsyncClient(base_url=env.url, timeout=60) as http:
            return await asyncio.gather(*(one_stream(http, p) for p in prompts))

    results = asyncio.run(all_streams())
    for p, (text, finishes) in zip(prompts, results, strict=True):
        alone = env.http.post("/v1/completions", json=body(p, False)).json()["choices"][0]
        assert finishes[-1] == "length" and finishes.count("length") == 1
        assert text == alone["text"]
    assert env.srv.wait_until(lambda: _idle(env.client))


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(env) -> None:
    before = env.http.get("/metrics").text
    aborted_before = (
        _metric(before, "pagedserve_request_success_total", '{finished_reason="abort"}')
        if 'finished_reason="abort"' in before else 0.0
    )
    body = {"prompt": "A paged cache splits the memory", "max_tokens": 480,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=env.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            got: list[str] = []
            for line in lines:
                if line.startswith("data: "):
                    got.append(line)
                if len(got) == 3:
                    break
            assert env.client.stats()["kv_blocks_used"] > 0
        # Leaving the block closes the connection mid-stream.
    assert env.srv.wait_until(lambda: _idle(env.client), timeout=10)
    after = env.http.get("/metrics").text
    assert _metric(after, "pagedserve_request_success_total", '{finished_reason="abort"}') == (
        aborted_before + 1
    )


def test_metrics_exposes_the_named_metrics_and_counters_increase(env) -> None:
    names = [
        "pagedserve_num_requests_running", "pagedserve_num_requests_waiting",
        "pagedserve_kv_cache_usage_perc", "pagedserve_prefix_cache_queries_total",
        "pagedserve_prefix_cache_hits_total", "pagedserve_num_preemptions_total",
        "pagedserve_prompt_tokens_total", "pagedserve_generation_tokens_total",
        "pagedserve_time_to_first_token_seconds_count",
        "pagedserve_time_per_output_token_seconds_count",
        "pagedserve_e2e_request_latency_seconds_count",
    ]
    resp = env.http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    before = {n: _metric(resp.text, n) for n in names}
    out = env.http.post("/v1/completions", json={
        "prompt": [1, 5, 6, 7, 8], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
    })
    assert out.status_code == 200
    after = {n: _metric(env.http.get("/metrics").text, n) for n in names}
    assert after["pagedserve_prompt_tokens_total"] == before["pagedserve_prompt_tokens_total"] + 5
    assert after["pagedserve_generation_tokens_total"] == (
        before["pagedserve_generation_tokens_total"] + 6
    )
    # Prefix caching is off in this module; the counters exist and stay put.
    assert after["pagedserve_prefix_cache_hits_total"] == 0
    for hist in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        key = f"pagedserve_{hist}_seconds_count"
        assert after[key] == before[key] + 1
    assert after["pagedserve_num_requests_running"] == 0
    assert 0.0 <= after["pagedserve_kv_cache_usage_perc"] <= 1.0


def test_two_apps_in_one_process_have_separate_registries(env) -> None:
    a, b = build_app(env.client), build_app(env.client)
    assert a.state.metrics.registry is not b.state.metrics.registry
    a.state.metrics.prompt_tokens.inc(3)
    text_b = b.state.metrics.render().decode()
    assert _metric(text_b, "pagedserve_prompt_tokens_total") == 0.0
