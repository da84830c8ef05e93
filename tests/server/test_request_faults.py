"""One bad request costs nobody else anything (issue 27, reproductions #1 and #8), and a 500
tells the client only "internal error" and the request id; the exception goes to the log."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx2 as httpx
import pytest

from pagedserve.serving.openai.server import build_app

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LONG = {"max_tokens": 40, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def env(llama_dir, srv) -> Iterator[SimpleNamespace]:
    client = srv.start_client(llama_dir, max_model_len=128)
    try:
        with srv.running(build_app(client)) as url, httpx.Client(base_url=url, timeout=60) as h:
            yield SimpleNamespace(client=client, http=h, url=url)
    finally:
        client.shutdown()


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _internal(resp: httpx.Response) -> str:
    """The request id of a 500, checked to be all the body tells."""
    err = _error(resp, 500)
    request_id = resp.headers["x-request-id"]
    assert err == {"message": f"internal error (request id {request_id})", "type": "server_error",
                   "param": None, "code": "internal_error"}
    return request_id


class _Stream:
    """A completion streamed on its own thread: its text and finish reason once it ends."""

    def __init__(self, url: str, path: str, body: dict[str, Any]) -> None:
        self.events: list[dict[str, Any]] = []
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, path, body), daemon=True)
        self._thread.start()
        assert self.started.wait(60), "the stream never sent a token"

    def _run(self, url: str, path: str, body: dict[str, Any]) -> None:
        with httpx.Client(base_url=url, timeout=60) as h, \
                h.stream("POST", path, json={**body, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    self.events.append(json.loads(line[6:]))
                    if any(c.get("text") or c.get("delta", {}).get("content")
                           for c in self.events[-1].get("choices", [])):
                        self.started.set()
        self.started.set()

    def result(self) -> tuple[str, str | None]:
        self._thread.join(60)
        assert not self._thread.is_alive()
        assert all("error" not in e for e in self.events), self.events
        choices = [c for e in self.events for c in e["choices"]]
        text = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in choices)
        return text, choices[-1]["finish_reason"]


# ------------------------------------------------------------------ #1: out-of-range integers


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        (COMPLETIONS, "top_k", 2**63),  # the reproduction
        (COMPLETIONS, "seed", 2**64),
        (COMPLETIONS, "n", 2**63),
        (COMPLETIONS, "max_tokens", 2**63),
        (COMPLETIONS, "min_tokens", 2**63),
        (COMPLETIONS, "logprobs", 2**63),
        (COMPLETIONS, "best_of", 2**63),
        (COMPLETIONS, "stop_token_ids", [2**63]),
        (COMPLETIONS, "prompt", [1, 2**63]),
        (CHAT, "top_k", 2**63),
        (CHAT, "max_completion_tokens", 2**63),
        (CHAT, "top_logprobs", 2**63),
    ],
)
def test_an_out_of_range_integer_is_a_400_and_costs_nobody_anything(env, path, field, value):
    engine = env.client.engine
    restarts, failures = engine.num_restarts, engine.restarts.recent_failures
    alone = env.http.post(COMPLETIONS, json={"prompt": "hello there", **LONG}).json()
    other = _Stream(env.url, COMPLETIONS, {"prompt": "hello there", **LONG})
    body = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
    err = _error(env.http.post(path, json={**body, "max_tokens": 2, field: value}), 400)
    assert err["param"] == field and err["type"] == "invalid_request_error"
    # The request in flight finished as it would have alone; the engine never restarted.
    assert other.result() == (alone["choices"][0]["text"], "length")
    assert engine.num_restarts == restarts and engine.restarts.recent_failures == failures
    assert env.http.get("/health").status_code == 200


def test_stop_token_ids_outside_the_vocabulary_are_a_400(env) -> None:
    vocab = env.client.vocab_size
    err = _error(env.http.post(COMPLETIONS, json={"prompt": "hi", "stop_token_ids": [vocab]}), 400)
    assert err["param"] == "stop_token_ids" and err["code"] == "InvalidParamTokenError"


# --------------------------------------------------------------------- #8: lone surrogates


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        (COMPLETIONS, '{"prompt": "hi \\ud800"}', "prompt"),
        (COMPLETIONS, '{"prompt": ["ok", "\\udfff"]}', "prompt"),
        (COMPLETIONS, '{"prompt": "hi", "model": "\\ud800"}', "model"),
        (COMPLETIONS, '{"prompt": "hi", "stop": ["\\ud800"]}', "stop"),
        (COMPLETIONS, '{"prompt": "hi", "user": "\\ud800"}', "user"),
        (CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
        (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
         "messages"),
        (CHAT, '{"messages": [{"role": "\\ud800", "content": "hi"}]}', "messages"),
        (CHAT, '{"messages": [{"role": "user", "content": "hi", "name": "\\ud800"}]}', "messages"),
        (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "model": "\\ud800"}', "model"),
        ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(env, path, raw, param) -> None:
    resp = env.http.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    err = _error(resp, 400)
    assert err["param"] == param and "Unicode" in err["message"]
    assert "Error" not in err["message"]  # no exception text
    assert env.http.get("/health").status_code == 200


# ---------------------------------------------------------------------- 500s: an id, no more


def test_every_answer_carries_a_request_id(env) -> None:
    ids = {env.http.get("/health").headers["x-request-id"],
           env.http.get("/v1/nowhere").headers["x-request-id"],
           env.http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1}).headers[
               "x-request-id"]}
    assert len(ids) == 3 and all(len(i) == 32 for i in ids)


class _BrokenClient:
    """A client that fails inside a route in a way no handler expects."""

    model_name = "fake"
    vocab_size = 512
    tokenizer = None

    @property
    def max_model_len(self) -> int:
        raise RuntimeError("secret-internals at /srv/model/weights")

    def is_healthy(self) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return {}

    def abort_request(self, request_id: str) -> None:
        pass


def test_an_unhandled_exception_is_a_500_with_only_an_id(caplog) -> None:
    app = build_app(_BrokenClient())  # type: ignore[arg-type]

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.get("/v1/models")

    with caplog.at_level(logging.ERROR):
        resp = asyncio.run(go())
    request_id = _internal(resp)
    assert "secret" not in resp.text
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None
    assert "secret-internals" in str(logged[0].exc_info[1])


def test_a_request_the_engine_failed_is_a_500_with_only_an_id(env, monkeypatch, caplog):
    """A value past every check (written into the params after validation) fails on the
    worker: that request gets the 500, streamed or not; a request beside it completes."""
    client = env.client
    submit = client.submit

    def corrupting(req, sink):
        if req.params.seed == 13:
            object.__setattr__(req.params, "top_k", 2**63)
        return submit(req, sink)

    monkeypatch.setattr(client, "submit", corrupting)
    restarts = client.engine.num_restarts
    alone = env.http.post(COMPLETIONS, json={"prompt": "hello there", **LONG}).json()
    other = _Stream(env.url, COMPLETIONS, {"prompt": "hello there", **LONG})
    bad = {"prompt": "hi", "seed": 13, "max_tokens": 4}
    with caplog.at_level(logging.ERROR):
        resp = env.http.post(COMPLETIONS, json=bad)
    request_id = _internal(resp)
    assert "Overflow" not in resp.text
    assert any(request_id in r.getMessage() and "OverflowError" in r.getMessage()
               for r in caplog.records)
    # Streamed: the stream ends with the same error event, naming its own id.
    with env.http.stream("POST", CHAT, json={
        "messages": [{"role": "user", "content": "hi"}], "seed": 13, "stream": True,
    }) as stream:
        assert stream.status_code == 200
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        stream_id = stream.headers["x-request-id"]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == f"internal error (request id {stream_id})"
    assert other.result() == (alone["choices"][0]["text"], "length")
    assert client.engine.num_restarts == restarts and client.is_healthy()
