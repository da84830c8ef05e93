"""``--allowed-origins`` (CORS, its preflight answered before the API key is asked for) and
``GET /version``."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import version

import httpx2 as httpx
import pytest

from pagedserve.serving.cli.serve import allowed_origins
from pagedserve.serving.openai.server import build_app

ALLOWED = "https://ui.example"


@pytest.fixture(scope="module")
def http(llama_dir, srv) -> Iterator[httpx.Client]:
    client = srv.start_client(llama_dir)
    try:
        app = build_app(client, api_key="k", allowed_origins=[ALLOWED])
        with srv.running(app) as url, httpx.Client(base_url=url, timeout=30) as h:
            yield h
    finally:
        client.shutdown()


def test_a_preflight_from_an_allowed_origin_passes_without_the_key(http) -> None:
    pre = http.options("/v1/chat/completions", headers={
        "Origin": ALLOWED, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == ALLOWED
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    got = http.get("/v1/models", headers={"Origin": ALLOWED, "Authorization": "Bearer k"})
    assert got.status_code == 200 and got.headers["access-control-allow-origin"] == ALLOWED
    # The key is still asked for on the call itself.
    assert http.get("/v1/models", headers={"Origin": ALLOWED}).status_code == 401


def test_another_origin_gets_no_cors_headers(http) -> None:
    pre = http.options("/v1/models", headers={"Origin": "https://evil.example",
                                              "Access-Control-Request-Method": "GET"})
    assert pre.status_code == 400 and "access-control-allow-origin" not in pre.headers
    got = http.get("/v1/models", headers={"Origin": "https://evil.example",
                                          "Authorization": "Bearer k"})
    assert "access-control-allow-origin" not in got.headers


def test_version(http) -> None:
    got = http.get("/version", headers={"Authorization": "Bearer k"})
    assert got.json() == {"version": version("pagedserve")}


@pytest.mark.parametrize(("flag", "origins"), [
    (None, []), ("*", ["*"]), ("https://a, https://b", ["https://a", "https://b"]),
    ('["https://a", "http://b:3000"]', ["https://a", "http://b:3000"]),
])
def test_the_flag_takes_a_comma_list_or_vllms_json_list(flag, origins) -> None:
    assert allowed_origins(flag) == origins


@pytest.mark.parametrize("flag", ['["a"', '[1]', '["a", null]'])
def test_a_bad_flag_is_refused(flag) -> None:
    with pytest.raises(ValueError, match="allowed-origins"):
        allowed_origins(flag)
