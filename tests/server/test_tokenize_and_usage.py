"""What a user of vLLM's server expects beyond the OpenAI routes: ``cached_tokens`` in the
usage, ``/tokenize`` and ``/detokenize``, ``best_of`` equal to ``n``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx2 as httpx
import pytest

from pagedserve.serving.openai.server import build_app

# Long enough to fill several 16-token blocks, so a repeat finds them in the prefix cache.
LONG = "A paged cache splits the memory of every sequence into fixed blocks. " * 3
CHAT = [{"role": "user", "content": "Tell me about paged attention, please."}]


@pytest.fixture(scope="module")
def env(llama_dir, srv) -> Iterator[SimpleNamespace]:
    from openai import OpenAI

    client = srv.start_client(llama_dir)
    try:
        with srv.running(build_app(client)) as url, httpx.Client(base_url=url, timeout=60) as h:
            oai = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            yield SimpleNamespace(client=client, http=h, oai=oai, model=client.model_name)
            oai.close()
    finally:
        client.shutdown()


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _full_blocks(env, n_tokens: int) -> int:
    """The prefix hit a repeat of an ``n_tokens`` prompt gets: whole blocks, short of the last
    token (which is always computed)."""
    b = env.client.block_size
    return (n_tokens - 1) // b * b


def test_cached_tokens_in_completion_usage(env) -> None:
    kw = dict(model=env.model, prompt=LONG + "first", max_tokens=2, temperature=0.0,
              extra_body={"cache_salt": "usage-test"})
    first = env.oai.completions.create(**kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = env.oai.completions.create(**kw)
    n = again.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == _full_blocks(env, n) > 0


def test_cached_tokens_summed_over_a_batch_of_prompts(env) -> None:
    prompts = [LONG + "one", LONG + "two, a little longer"]
    salt = {"cache_salt": "batch-usage"}
    env.oai.completions.create(model=env.model, prompt=prompts, max_tokens=1, extra_body=salt)
    again = env.oai.completions.create(model=env.model, prompt=prompts, max_tokens=1,
                                       extra_body=salt)
    lens = [len(env.client.tokenizer.encode(p)) for p in prompts]
    expected = sum(_full_blocks(env, n) for n in lens)
    assert again.usage.prompt_tokens_details.cached_tokens == expected > 0


def test_cached_tokens_in_the_streamed_usage_chunk_and_chat(env) -> None:
    kw = dict(model=env.model, messages=CHAT, max_tokens=2, temperature=0.0,
              extra_body={"cache_salt": "chat-usage"})
    env.oai.chat.completions.create(**kw)
    chunks = list(env.oai.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw))
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.prompt_tokens_details.cached_tokens == _full_blocks(env, usage.prompt_tokens)
    whole = env.oai.chat.completions.create(**kw)
    assert whole.usage.prompt_tokens_details.cached_tokens == _full_blocks(
        env, whole.usage.prompt_tokens) > 0


def test_tokenize_a_prompt_like_completions_does(env) -> None:
    tok = env.client.tokenizer
    resp = env.http.post("/tokenize", json={"model": env.model, "prompt": LONG})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["tokens"] == tok.encode(LONG) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == env.client.max_model_len and body["token_strs"] is None
    out = env.oai.completions.create(model=env.model, prompt=LONG, max_tokens=1)
    assert out.usage.prompt_tokens == body["count"]
    plain = env.http.post("/tokenize", json={"prompt": LONG, "add_special_tokens": False,
                                             "return_token_strs": True}).json()
    assert plain["tokens"] == list(tok.hf.encode(LONG, add_special_tokens=False))
    assert plain["token_strs"] == tok.hf.convert_ids_to_tokens(plain["tokens"])


def test_tokenize_messages_like_chat_does(env) -> None:
    body = env.http.post("/tokenize", json={"messages": CHAT}).json()
    out = env.oai.chat.completions.create(model=env.model, messages=CHAT, max_tokens=1)
    assert body["count"] == out.usage.prompt_tokens == len(body["tokens"])
    bare = env.http.post("/tokenize", json={"messages": CHAT,
                                            "add_generation_prompt": False}).json()
    assert bare["count"] < body["count"]
    assert body["tokens"][:bare["count"]] == bare["tokens"]


def test_detokenize_round_trips(env) -> None:
    ids = env.http.post("/tokenize", json={"prompt": "Hello paged world",
                                           "add_special_tokens": False}).json()["tokens"]
    resp = env.http.post("/detokenize", json={"model": env.model, "tokens": ids})
    assert resp.status_code == 200 and resp.json() == {"prompt": "Hello paged world"}
    assert env.http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    ],
)
def test_bad_tokenize_input_gets_the_openai_error_body(env, path, body, status, param) -> None:
    err = _error(env.http.post(path, json=body), status)
    assert err["param"] == param


def test_tokenize_bad_json_is_400(env) -> None:
    resp = env.http.post("/tokenize", content=b'{"prompt": ', headers={
        "content-type": "application/json"})
    _error(resp, 400)


def test_best_of_equal_to_n_or_null_is_accepted(env) -> None:
    base = {"model": env.model, "prompt": "Hello", "max_tokens": 2}
    for best_of, n in ((None, 1), (1, 1), (2, 2)):
        resp = env.http.post("/v1/completions", json={**base, "n": n, "best_of": best_of})
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["choices"]) == n
    err = _error(env.http.post("/v1/completions", json={**base, "n": 1, "best_of": 3}), 400)
    assert err["param"] == "best_of"


def test_usage_details_survive_json_round_trip(env) -> None:
    resp = env.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    usage = json.loads(resp.text)["usage"]
    assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens",
                          "prompt_tokens_details"}
    assert set(usage["prompt_tokens_details"]) == {"cached_tokens", "cached_tokens_host"}
