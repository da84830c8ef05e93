"""Raw HTTP: every error answers in the OpenAI shape with the right status."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx2 as httpx
import pytest

from pagedserve.controller.errors import EngineDeadError, EngineOverloadedError
from pagedserve.serving.openai.server import build_app

KEY = "sekrit-key"


@pytest.fixture(scope="module")
def env(llama_dir, srv) -> Iterator[SimpleNamespace]:
    client = srv.start_client(llama_dir, max_model_len=128)
    try:
        with srv.running(build_app(client)) as url, \
                srv.running(build_app(client, api_key=KEY)) as keyed_url:
            with httpx.Client(base_url=url, timeout=60) as http, \
                    httpx.Client(base_url=keyed_url, timeout=60) as keyed:
                yield SimpleNamespace(client=client, http=http, keyed=keyed,
                                      model=client.model_name)
    finally:
        client.shutdown()


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_malformed_json_is_400(env) -> None:
    resp = env.http.post("/v1/completions", content=b'{"prompt": "hi", ',
                         headers={"content-type": "application/json"})
    err = _error(resp, 400)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": {"text": "hi"}}, "prompt"),
        ({"prompt": "hi", "stream": [1]}, "stream"),
        ({}, "prompt"),
    ],
)
def test_wrong_types_are_400_naming_the_field(env, body, param) -> None:
    err = _error(env.http.post("/v1/completions", json=body), 400)
    assert err["param"] == param


def test_chat_wrong_types_are_400(env) -> None:
    err = _error(env.http.post("/v1/chat/completions", json={"messages": "hello"}), 400)
    assert err["param"] == "messages"
    err = _error(env.http.post("/v1/chat/completions", json={"messages": []}), 400)
    assert err["param"] == "messages"


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1.0), ("top_p", 0.0), ("n", 0), ("max_tokens", 0), ("top_k", -5),
     ("logprobs", 50), ("seed", -3)],
)
def test_invalid_sampling_values_are_400_naming_the_param(env, field, value) -> None:
    err = _error(env.http.post("/v1/completions", json={"prompt": "hi", field: value}), 400)
    assert err["param"] == field


def test_chat_param_names_follow_the_request(env) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
            "top_logprobs": 99}
    assert _error(env.http.post("/v1/chat/completions", json=body), 400)["param"] == (
        "top_logprobs"
    )
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000}
    err = _error(env.http.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == "max_completion_tokens" and err["code"] == "context_length_exceeded"


def test_context_limits(env) -> None:
    # max_tokens alone overflows the remaining context: 400, like vLLM.
    err = _error(env.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10**6}),
                 400)
    assert err["param"] == "max_tokens" and "128" in err["message"]
    # The prompt alone is too long.
    err = _error(env.http.post("/v1/completions", json={"prompt": [5] * 200}), 400)
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    # Exactly filling the context is fine.
    ok = env.http.post("/v1/completions",
                       json={"prompt": [5] * 120, "max_tokens": 8, "temperature": 0})
    assert ok.status_code == 200, ok.text


def test_empty_and_invalid_token_prompts_are_400(env) -> None:
    err = _error(env.http.post("/v1/completions", json={"prompt": []}), 400)
    assert err["param"] == "prompt" and err["code"] == "EmptyPromptError"
    err = _error(env.http.post("/v1/completions", json={"prompt": [1, 99999]}), 400)
    assert err["param"] == "prompt" and err["code"] == "InvalidTokenError"
    err = _error(env.http.post("/v1/completions", json={"prompt": [1, -1]}), 400)
    assert err["code"] == "InvalidTokenError"


def test_unknown_model_is_404(env) -> None:
    err = _error(env.http.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    chat = {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}
    assert _error(env.http.post("/v1/chat/completions", json=chat), 404)["code"] == (
        "model_not_found"
    )
    assert _error(env.http.get("/v1/nowhere"), 404)["type"] == "not_found_error"


def test_api_key_protects_everything_but_health(env) -> None:
    assert env.keyed.get("/health").status_code == 200
    for path in ("/v1/models", "/metrics"):
        assert _error(env.keyed.get(path), 401)["code"] == "invalid_api_key"
        wrong = env.keyed.get(path, headers={"Authorization": "Bearer nope"})
        assert _error(wrong, 401)["code"] == "invalid_api_key"
        assert env.keyed.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    body = {"model": env.model, "prompt": "hi", "max_tokens": 2}
    _error(env.keyed.post("/v1/completions", json=body), 401)
    ok = env.keyed.post("/v1/completions", json=body,
                        headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
    # The app without a key stays open.
    assert env.http.get("/v1/models").status_code == 200


# ---------------------------------------------------------------------------- dead engines


class DeadClient:
    """A client whose engine is gone: the protocol, answering as a dead engine does."""

    model_name = "fake"
    max_model_len = 64
    vocab_size = 512
    tokenizer = None

    def __init__(self, healthy: bool) -> None:
        self.healthy = healthy

    error = "worker 0 died"

    def add_request(self, request, sink) -> None:
        raise EngineDeadError("worker 0 died")

    def submit(self, request, sink):
        raise EngineDeadError("worker 0 died")

    def wait_added(self, fut) -> None:
        fut.result()

    def abort_request(self, request_id: str) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        raise EngineDeadError("worker 0 died")

    def is_healthy(self) -> bool:
        return self.healthy

    def shutdown(self) -> None:
        pass


class OverloadedClient(DeadClient):
    """A healthy engine that already holds max_pending_requests requests."""

    def __init__(self) -> None:
        super().__init__(True)

    def submit(self, request, sink):
        raise EngineOverloadedError("the engine holds 2 requests (max_pending_requests)")

    def stats(self) -> dict[str, Any]:
        return {}


def test_a_full_engine_is_a_typed_503() -> None:
    app = build_app(OverloadedClient())

    async def go() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            resp = await http.post("/v1/completions", json={"prompt": [1, 2, 3]})
            err = _error(resp, 503)
            assert err["code"] == "engine_overloaded" and "max_pending_requests" in err["message"]
            assert (await http.get("/health")).status_code == 200

    asyncio.run(go())


@pytest.mark.parametrize("healthy", [False, True])
def test_dead_engine_is_503_over_asgi(healthy: bool) -> None:
    app = build_app(DeadClient(healthy))

    async def go() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            resp = await http.post("/v1/completions", json={"prompt": [1, 2, 3]})
            err = _error(resp, 503)
            assert err["code"] == "engine_unavailable"
            assert (await http.get("/health")).status_code == (200 if healthy else 503)
            metrics = await http.get("/metrics")  # stats() failing must not break /metrics
            assert metrics.status_code == 200

    asyncio.run(go())


def test_engine_that_dies_mid_request_answers_503(llama_dir, srv) -> None:
    client = srv.start_client(llama_dir)

    def boom(_: Any) -> Any:
        raise RuntimeError("worker exploded")

    try:
        with srv.running(build_app(client)) as url, httpx.Client(base_url=url, timeout=60) as h:
            assert h.get("/health").status_code == 200
            body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
            with h.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["choices"][0]["text"] is not None
                # The engine dies while the stream is open: it ends with an error event.
                client.engine.executor.execute = boom
                rest = [line[6:] for line in lines if line.startswith("data: ")]
            assert rest[-1] == "[DONE]"
            err = json.loads(rest[-2])["error"]
            assert err["code"] == "engine_unavailable" and "worker exploded" in err["message"]
            assert h.get("/health").status_code == 503
            err = _error(h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}), 503)
            assert err["type"] == "service_unavailable_error"
            chat = {"messages": [{"role": "user", "content": "x"}]}
            assert _error(h.post("/v1/chat/completions", json=chat), 503)["code"] == (
                "engine_unavailable"
            )
    finally:
        client.shutdown()
