"""``/v1/completions`` with ``echo`` and ``logprobs``: the prompt's logprobs (first null) before
the completion's, checked against transformers; ``max_tokens: 0`` scores the prompt alone."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import httpx2 as httpx
import pytest

from pagedserve.serving.openai.server import build_app

PROMPT = "The quick brown fox jumps over the lazy dog."
TOL = 1e-4


@pytest.fixture(scope="module")
def env(llama_dir, srv) -> Iterator[SimpleNamespace]:
    import torch
    from helpers.checkpoints import load_hf_model
    from openai import OpenAI

    client = srv.start_client(llama_dir)
    ids = client.tokenizer.encode(PROMPT)
    with torch.no_grad():
        logits = load_hf_model(llama_dir)(torch.tensor([ids])).logits[0].float()
    try:
        with srv.running(build_app(client)) as url:
            oai = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            yield SimpleNamespace(client=client, oai=oai, model=client.model_name, url=url,
                                  ids=ids, ref=logits.log_softmax(-1))
            oai.close()
    finally:
        client.shutdown()


def _kw(env, **extra):
    return dict(model=env.model, prompt=PROMPT, temperature=0.0, extra_body={"ignore_eos": True},
                **extra)


def _check_prompt_part(env, lp, top: int) -> float:
    """The first len(prompt) entries are the prompt's; returns the worst difference."""
    n = len(env.ids)
    tok = env.client.tokenizer
    assert lp.tokens[:n] == [tok.decode([t], skip_special_tokens=False) for t in env.ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    worst = 0.0
    for p in range(1, n):
        want = env.ref[p - 1, env.ids[p]].item()
        worst = max(worst, abs(lp.token_logprobs[p] - want))
        values, ids = env.ref[p - 1].topk(top)
        names = [tok.decode([t], skip_special_tokens=False) for t in ids.tolist()]
        tops = lp.top_logprobs[p]
        assert set(tops) == set(names)  # distinct ids may decode alike: fewer keys then
        for name, v in zip(names, values.tolist(), strict=True):
            if names.count(name) == 1:
                worst = max(worst, abs(tops[name] - v))
    assert worst < TOL, worst
    return worst


def _offsets_are_cumulative(lp) -> None:
    at = 0
    for tok, off in zip(lp.tokens, lp.text_offset, strict=True):
        assert off == at
        at += len(tok)


def test_echo_with_logprobs(env) -> None:
    plain = env.oai.completions.create(**_kw(env, max_tokens=5, logprobs=2)).choices[0]
    out = env.oai.completions.create(**_kw(env, max_tokens=5, logprobs=2, echo=True))
    (choice,) = out.choices
    assert choice.text == PROMPT + plain.text
    lp = choice.logprobs
    n = len(env.ids)
    assert len(lp.tokens) == n + 5
    _check_prompt_part(env, lp, 2)
    # The completion's part is what the same request without echo returns.
    assert lp.tokens[n:] == plain.logprobs.tokens
    assert lp.token_logprobs[n:] == plain.logprobs.token_logprobs
    _offsets_are_cumulative(lp)
    assert out.usage.prompt_tokens == n and out.usage.completion_tokens == 5


def test_echo_max_tokens_zero_scores_the_prompt(env) -> None:
    out = env.oai.completions.create(**_kw(env, max_tokens=0, logprobs=1, echo=True))
    (choice,) = out.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(env.ids)
    _check_prompt_part(env, choice.logprobs, 1)
    assert out.usage.completion_tokens == 0
    # Without echo there is nothing to return: refused.
    r = httpx.post(f"{env.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_streaming_sends_the_prompt_logprobs_first(env) -> None:
    whole = env.oai.completions.create(**_kw(env, max_tokens=4, logprobs=2, echo=True))
    chunks = [c for c in env.oai.completions.create(
        **_kw(env, max_tokens=4, logprobs=2, echo=True, stream=True)) if c.choices]
    first = chunks[0].choices[0]
    n = len(env.ids)
    assert first.text.startswith(PROMPT)
    assert len(first.logprobs.tokens) >= n
    _check_prompt_part(env, first.logprobs, 2)
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert tokens == whole.choices[0].logprobs.tokens
    assert values == whole.choices[0].logprobs.token_logprobs
    assert offsets == whole.choices[0].logprobs.text_offset
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    # The prompt alone, streamed: one chunk with all of it.
    alone = [c for c in env.oai.completions.create(
        **_kw(env, max_tokens=0, logprobs=0, echo=True, stream=True)) if c.choices]
    assert "".join(c.choices[0].text for c in alone) == PROMPT
    assert len(alone[0].choices[0].logprobs.tokens) == n


def test_echo_logprobs_for_every_choice_and_token_prompts(env) -> None:
    out = env.oai.completions.create(
        model=env.model, prompt=PROMPT, max_tokens=3, n=2, temperature=1.0, seed=4,
        logprobs=1, echo=True,
    )
    assert len(out.choices) == 2
    for choice in out.choices:
        assert len(choice.logprobs.tokens) == len(env.ids) + 3
        _check_prompt_part(env, choice.logprobs, 1)
    # A prompt of token ids echoes its decoded text.
    out = env.oai.completions.create(**{**_kw(env, max_tokens=0, logprobs=0, echo=True),
                                        "prompt": env.ids})
    choice = out.choices[0]
    assert choice.text == env.client.tokenizer.decode(env.ids, skip_special_tokens=False)
    _check_prompt_part(env, choice.logprobs, 0)
