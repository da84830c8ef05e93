"""The official ``openai`` client against a real uvicorn server over a tiny Llama."""

from __future__ import annotations

import re
from collections.abc import Iterator
from types import SimpleNamespace

import httpx2 as httpx
import pytest

PROMPT = "The quick brown fox jumps over the lazy dog."
CHAT = [
    {"role": "system", "content": "You are a helpful robot."},
    {"role": "user", "content": "Hello, how are you today?"},
]


@pytest.fixture(scope="module")
def env(llama_dir, srv) -> Iterator[SimpleNamespace]:
    with srv.openai(llama_dir) as e:
        yield e


def _prompt_len(env, text: str) -> int:
    return len(env.client.tokenizer.encode(text))


def test_models_lists_the_served_model(env) -> None:
    models = env.oai.models.list()
    assert [m.id for m in models.data] == [env.model] == ["tiny-llama"]
    assert models.data[0].object == "model"


def test_completion_non_streaming_and_usage(env) -> None:
    out = env.oai.completions.create(
        model=env.model, prompt=PROMPT, max_tokens=12, temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert out.object == "text_completion" and out.model == env.model
    assert len(out.choices) == 1 and out.choices[0].finish_reason == "length"
    assert isinstance(out.choices[0].text, str) and out.choices[0].text
    assert out.usage.prompt_tokens == _prompt_len(env, PROMPT)
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_greedy_stream_equals_non_stream_completion(env) -> None:
    kw = dict(model=env.model, prompt=PROMPT, max_tokens=24, temperature=0.0,
              extra_body={"ignore_eos": True})
    whole = env.oai.completions.create(**kw)
    chunks = list(env.oai.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    # include_usage: the last chunk has no choices and the usage; the others have usage null.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_non_streaming_and_streaming_agree(env) -> None:
    kw = dict(model=env.model, messages=CHAT, max_completion_tokens=20, temperature=0.0,
              extra_body={"ignore_eos": True})
    whole = env.oai.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert whole.object == "chat.completion" and msg.role == "assistant" and msg.content
    rendered = env.client.tokenizer.hf.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=False
    )
    prompt_ids = env.client.tokenizer.hf.encode(rendered, add_special_tokens=False)
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.completion_tokens == 20
    chunks = list(env.oai.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == msg.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_2_with_seed_gives_two_reproducible_choices(env) -> None:
    kw = dict(model=env.model, prompt=PROMPT, max_tokens=10, n=2, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    a = env.oai.completions.create(**kw)
    b = env.oai.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 20
    assert a.usage.prompt_tokens == _prompt_len(env, PROMPT)
    streamed = list(env.oai.completions.create(stream=True, **kw))
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [c.text for c in a.choices]


def test_token_prompt_batch_and_top_k(env) -> None:
    ids = env.client.tokenizer.encode(PROMPT)
    single = env.oai.completions.create(
        model=env.model, prompt=ids, max_tokens=8, temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    text = env.oai.completions.create(
        model=env.model, prompt=PROMPT, max_tokens=8, temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert single.choices[0].text == text.choices[0].text
    batch = env.oai.completions.create(
        model=env.model, prompt=[ids, ids[:5]], max_tokens=4, temperature=0.5,
        extra_body={"ignore_eos": True, "top_k": 5},
    )
    assert sorted(c.index for c in batch.choices) == [0, 1]
    assert batch.usage.prompt_tokens == len(ids) + 5
    assert batch.usage.completion_tokens == 8


def test_completion_logprobs(env) -> None:
    out = env.oai.completions.create(
        model=env.model, prompt=PROMPT, max_tokens=5, temperature=0.0, logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert token_lp <= 0.0 and 1 <= len(top) <= 3
        # Greedy: the sampled token is the most likely one.
        assert token_lp == pytest.approx(max(top.values()))


def test_chat_logprobs(env) -> None:
    out = env.oai.chat.completions.create(
        model=env.model, messages=CHAT, max_tokens=4, temperature=0.0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0.0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)


def test_stop_string_streamed_equals_non_streamed(env) -> None:
    kw = dict(model=env.model, prompt=PROMPT, max_tokens=40, temperature=0.0,
              extra_body={"ignore_eos": True})
    free = env.oai.completions.create(**kw).choices[0].text
    assert len(free) > 6
    stop = free[3:5]  # a stop string that certainly occurs
    whole = env.oai.completions.create(stop=[stop], **kw).choices[0]
    assert whole.finish_reason == "stop" and stop not in whole.text
    assert free.startswith(whole.text)
    streamed = "".join(
        c.choices[0].text for c in env.oai.completions.create(stop=[stop], stream=True, **kw)
        if c.choices
    )
    assert streamed == whole.text


def test_cache_salt_is_accepted_and_isolates(env) -> None:
    long_prompt = PROMPT * 4
    kw = dict(model=env.model, prompt=long_prompt, max_tokens=2, temperature=0.0)
    before = env.client.stats()["prefix_cache_hits"]
    env.oai.completions.create(extra_body={"cache_salt": "tenant-a"}, **kw)
    env.oai.completions.create(extra_body={"cache_salt": "tenant-b"}, **kw)
    assert env.client.stats()["prefix_cache_hits"] == before
    queries = _metric(env, "pagedserve_prefix_cache_queries_total")
    env.oai.completions.create(extra_body={"cache_salt": "tenant-a"}, **kw)
    hits = env.client.stats()["prefix_cache_hits"]
    assert hits > before
    # /metrics reports the same engine counters.
    assert _metric(env, "pagedserve_prefix_cache_hits_total") == hits
    assert _metric(env, "pagedserve_prefix_cache_queries_total") > queries


def _metric(env, name: str) -> float:
    text = httpx.get(f"{env.url}/metrics").text
    m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert m is not None, name
    return float(m.group(1))


def test_echo_prepends_the_prompt(env) -> None:
    kw = dict(model=env.model, prompt=PROMPT, max_tokens=6, temperature=0.0,
              extra_body={"ignore_eos": True})
    plain = env.oai.completions.create(**kw).choices[0].text
    echoed = env.oai.completions.create(echo=True, **kw).choices[0].text
    assert echoed == PROMPT + plain
    streamed = "".join(
        c.choices[0].text for c in env.oai.completions.create(echo=True, stream=True, **kw)
        if c.choices
    )
    assert streamed == echoed


def test_many_short_concurrent_streams_equal_their_non_streamed_twins(env) -> None:
    """Short streams end in the same engine steps as their neighbours' writes: each must still
    carry all its text and its finish_reason, as the same request non-streamed does."""
    import asyncio

    from openai import AsyncOpenAI

    requests = [dict(prompt=f"{PROMPT} {i}", max_tokens=1 + i % 16) for i in range(24)]

    async def one(oai: AsyncOpenAI, req: dict, stream: bool) -> tuple[str, str | None]:
        kw = dict(model=env.model, temperature=0.0, extra_body={"ignore_eos": True}, **req)
        if not stream:
            choice = (await oai.completions.create(**kw)).choices[0]
            return choice.text, choice.finish_reason
        text, reason = "", None
        async for chunk in await oai.completions.create(stream=True, **kw):
            for c in chunk.choices:
                text += c.text
                reason = c.finish_reason or reason
        return text, reason

    async def main() -> tuple[list, list]:
        async with AsyncOpenAI(base_url=f"{env.url}/v1", api_key="unused", max_retries=0,
                               timeout=60) as oai:
            whole = await asyncio.gather(*(one(oai, r, False) for r in requests))
            streamed = []
            for _ in range(6):  # 144 streams
                streamed.append(await asyncio.gather(*(one(oai, r, True) for r in requests)))
            return whole, streamed

    whole, rounds = asyncio.run(main())
    assert all(reason == "length" for _, reason in whole)
    lost = [(i, got, want) for streamed in rounds
            for i, (got, want) in enumerate(zip(streamed, whole, strict=True)) if got != want]
    assert not lost, f"{len(lost)} of {24 * len(rounds)} streams differ: {lost[:3]}"
