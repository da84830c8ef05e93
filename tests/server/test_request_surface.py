"""The request surface against vLLM's: every field of vLLM's completion and chat request models
(and OpenAI's) is either honoured or refused with a 400 naming it, never ignored; an unknown
field is a 400 naming it. Then each field this server implements beyond the basics, end to end
on a tiny random Llama: ``logit_bias`` and ``allowed_token_ids`` steer greedy sampling,
``include_stop_str_in_output`` keeps the stop, ``prompt_logprobs`` agrees with echo's prompt
logprobs, ``truncate_prompt_tokens`` and ``add_special_tokens`` shape the prompt,
``request_id`` names the answer (a duplicate in flight is a 400), ``return_token_ids`` returns
ids that decode to the text, and the chat template's ``continue_final_message``,
``documents`` and ``chat_template_kwargs`` reach it (control-token text in them stays text)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx2 as httpx
import pytest

from pagedserve.serving.openai.protocol import ChatCompletionRequest, CompletionRequest

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "The quick brown fox"}]
BASE: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"prompt": "The quick brown fox", "max_tokens": 2},
    CHAT: {"messages": MSGS, "max_tokens": 2},
}

# The request fields of vLLM's CompletionRequest and ChatCompletionRequest
# (vllm/entrypoints/openai/protocol.py, v0.10) and of OpenAI's chat API reference.
VLLM_COMMON = {
    "model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "response_format", "seed", "stop", "stream", "stream_options",
    "temperature", "top_p", "user", "best_of", "use_beam_search", "top_k", "min_p",
    "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs", "bad_words", "echo",
    "add_special_tokens", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern", "priority",
    "request_id", "logits_processors", "return_tokens_as_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs",
}
VLLM_COMPLETION = VLLM_COMMON | {"prompt", "suffix", "prompt_embeds"}
VLLM_CHAT = VLLM_COMMON | {
    "messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
    "reasoning_effort", "include_reasoning", "parallel_tool_calls", "add_generation_prompt",
    "continue_final_message", "documents", "chat_template", "chat_template_kwargs",
    "mm_processor_kwargs",
}
OPENAI_CHAT = {
    "audio", "function_call", "functions", "metadata", "modalities", "prediction",
    "prompt_cache_key", "safety_identifier", "service_tier", "store", "verbosity",
    "web_search_options",
}

# field -> (a value that uses it, honoured?); the value of a refused field is one it would act
# on. Per endpoint where the two differ.
OK, REFUSED = True, False
COMMON: dict[str, tuple[Any, bool]] = {
    "frequency_penalty": (0.5, OK), "presence_penalty": (0.5, OK), "temperature": (0.7, OK),
    "top_p": (0.9, OK), "seed": (3, OK), "n": (2, OK), "stop": (["zz"], OK),
    "stream": (False, OK), "stream_options": ({"include_usage": False}, OK), "user": ("u", OK),
    "safety_identifier": ("s", OK), "prompt_cache_key": ("k", OK), "best_of": (1, OK),
    "top_k": (5, OK), "min_p": (0.1, OK), "repetition_penalty": (1.1, OK),
    "stop_token_ids": ([2], OK), "include_stop_str_in_output": (True, OK),
    "ignore_eos": (True, OK), "min_tokens": (1, OK), "skip_special_tokens": (False, OK),
    "truncate_prompt_tokens": (3, OK), "allowed_token_ids": ([5, 6], OK),
    "prompt_logprobs": (1, OK), "logit_bias": ({"5": 2.0}, OK), "priority": (0, OK),
    "return_tokens_as_token_ids": (True, OK), "return_token_ids": (True, OK),
    "cache_salt": ("tenant", OK), "request_id": ("surface", OK),
    "response_format": ({"type": "text"}, OK),
    "structured_outputs": ({"choice": ["a", "b"]}, OK), "guided_choice": (["a", "b"], OK),
    "guided_regex": ("a+", OK), "guided_json": ({"type": "string"}, OK),
    "guided_grammar": ('start: "a"', OK), "add_special_tokens": (True, OK),
    "use_beam_search": (True, REFUSED), "length_penalty": (0.5, REFUSED),
    "spaces_between_special_tokens": (False, REFUSED), "bad_words": (["fox"], REFUSED),
    "logits_processors": (["my.Processor"], REFUSED),
    "guided_decoding_backend": ("xgrammar", REFUSED),
    "guided_whitespace_pattern": (" ", REFUSED), "structural_tag": ("{}", REFUSED),
    "kv_transfer_params": ({"do_remote_decode": True}, REFUSED),
    "vllm_xargs": ({"a": 1}, REFUSED), "mm_processor_kwargs": ({"a": 1}, REFUSED),
    "store": (True, REFUSED), "metadata": ({"k": "v"}, REFUSED),
    "service_tier": ("flex", REFUSED),
}
PER_ENDPOINT: dict[str, dict[str, tuple[Any, bool]]] = {
    COMPLETIONS: {
        "logprobs": (1, OK), "echo": (True, OK), "suffix": (" end", REFUSED),
        "prompt_embeds": ("AAAA", REFUSED),
    },
    CHAT: {
        "logprobs": (True, OK), "top_logprobs": (1, OK), "max_completion_tokens": (2, OK),
        "add_generation_prompt": (False, OK), "continue_final_message": (True, OK),
        "documents": ([{"title": "t", "text": "x"}], OK),
        "chat_template_kwargs": ({"persona": "p"}, OK), "parallel_tool_calls": (False, OK),
        "echo": (True, REFUSED), "chat_template": ("{{ messages }}", REFUSED),
        "tools": ([{"type": "function", "function": {"name": "f"}}], OK),
        "tool_choice": ("required", OK), "reasoning_effort": ("low", REFUSED),
        "include_reasoning": (False, OK), "modalities": (["audio"], REFUSED),
        "prediction": ({"type": "content", "content": "x"}, REFUSED),
        "web_search_options": ({}, REFUSED), "functions": ([{"name": "f"}], REFUSED),
        "function_call": ("auto", REFUSED), "audio": ({"voice": "a"}, REFUSED),
        "verbosity": ("low", REFUSED),
    },
}
# What a field needs beside it to be used at all.
COMPANIONS: dict[str, dict[str, Any]] = {
    "top_logprobs": {"logprobs": True},
    "continue_final_message": {"messages": [*MSGS, {"role": "assistant", "content": "jumps"}]},
    "best_of": {"n": 1},
    "stream_options": {"stream": True},
    # This template shows no tool-call syntax, so tool_choice auto has no parser to read with.
    "tools": {"tool_choice": "none"},
    "tool_choice": {"tools": [{"type": "function", "function": {"name": "f"}}],
                    "max_tokens": 24},
}


@pytest.fixture(scope="module")
def env(llama_dir: Path, srv: Any) -> Iterator[SimpleNamespace]:
    with srv.openai(llama_dir) as e, httpx.Client(base_url=e.url, timeout=60) as http:
        e.http = http
        yield e


def _table(path: str) -> dict[str, tuple[Any, bool]]:
    return {**COMMON, **PER_ENDPOINT[path]}


def _post(env: SimpleNamespace, path: str, body: dict[str, Any]) -> httpx.Response:
    return env.http.post(path, json={**BASE[path], **body})


def _error(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


@pytest.mark.parametrize(("path", "model", "reference"), [
    (COMPLETIONS, CompletionRequest, VLLM_COMPLETION | {"structured_outputs", "return_token_ids",
                                                        "store", "metadata", "service_tier",
                                                        "safety_identifier",
                                                        "prompt_cache_key"}),
    (CHAT, ChatCompletionRequest, VLLM_CHAT | OPENAI_CHAT | {"structured_outputs",
                                                            "return_token_ids"}),
])
def test_the_schema_declares_every_reference_field_and_the_table_covers_it(
    path: str, model: type, reference: set[str]
) -> None:
    declared = set(model.model_fields)
    assert reference <= declared, reference - declared
    assert declared == set(_table(path)) | set(BASE[path]) | {"model"}, (
        declared ^ (set(_table(path)) | set(BASE[path]) | {"model"}))


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_every_field_is_honoured_or_refused_by_name(env, path: str) -> None:
    for name, (value, honoured) in _table(path).items():
        resp = _post(env, path, {**COMPANIONS.get(name, {}), name: value})
        if honoured:
            assert resp.status_code == 200, (name, resp.text)
        else:
            err = _error(resp)
            assert err["param"] == name, (name, err)
            assert "not supported" in err["message"], (name, err)


@pytest.mark.parametrize(("path", "body", "where"), [
    (COMPLETIONS, {"bogus_field": 1}, "bogus_field"),
    (COMPLETIONS, {"stream": True, "stream_options": {"include_usage": True, "every": 1}},
     "stream_options.every"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "color": "red"}]},
     "messages.0.color"),
    (CHAT, {"response_format": {"type": "text", "strictness": 2}}, "response_format"),
])
def test_an_unknown_field_is_refused_by_name(env, path: str, body: dict, where: str) -> None:
    err = _error(_post(env, path, body))
    assert where in err["message"] and err["code"] == "unknown_field", err


def _greedy_ids(env, extra: dict[str, Any], max_tokens: int = 4) -> list[int]:
    out = _post(env, COMPLETIONS, {"temperature": 0, "max_tokens": max_tokens,
                                   "ignore_eos": True, "return_token_ids": True, **extra})
    assert out.status_code == 200, out.text
    return out.json()["choices"][0]["token_ids"]


def test_logit_bias_and_allowed_token_ids_steer_greedy_sampling(env) -> None:
    plain = _greedy_ids(env, {})
    other = (plain[0] + 7) % 500 + 5
    assert _greedy_ids(env, {"logit_bias": {str(other): 100}})[0] == other
    assert _greedy_ids(env, {"logit_bias": {str(plain[0]): -100}})[0] != plain[0]
    allowed = [other, other + 1, other + 2]
    assert set(_greedy_ids(env, {"allowed_token_ids": allowed}, 8)) <= set(allowed)
    err = _error(_post(env, COMPLETIONS, {"logit_bias": {"x1": 1}}))
    assert err["param"] == "logit_bias"
    err = _error(_post(env, COMPLETIONS, {"allowed_token_ids": [10**6]}))
    assert err["param"] == "allowed_token_ids"


def test_include_stop_str_in_output_keeps_the_stop(env) -> None:
    tok = env.client.tokenizer
    ids = _greedy_ids(env, {}, 8)
    text = tok.decode(ids)
    stop = text[3:6]
    assert stop.strip(), text
    kw = {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "stop": [stop]}
    cut = _post(env, COMPLETIONS, kw).json()["choices"][0]
    kept = _post(env, COMPLETIONS, {**kw, "include_stop_str_in_output": True}).json()
    kept = kept["choices"][0]
    assert cut["finish_reason"] == kept["finish_reason"] == "stop"
    assert kept["text"] == cut["text"] + stop and text.startswith(kept["text"])
    # A stop token's text too.
    kw = {"temperature": 0, "max_tokens": 8, "stop_token_ids": [ids[2]], "ignore_eos": True}
    cut = _post(env, COMPLETIONS, kw).json()["choices"][0]["text"]
    kept = _post(env, COMPLETIONS, {**kw, "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == cut + tok.decode([ids[2]], skip_special_tokens=False)


def test_prompt_logprobs_agree_with_echo(env) -> None:
    body = {"max_tokens": 1, "temperature": 0}
    got = _post(env, COMPLETIONS, {**body, "prompt_logprobs": 2}).json()["choices"][0]
    echo = _post(env, COMPLETIONS, {**body, "echo": True, "logprobs": 0}).json()["choices"][0]
    prompt_ids = env.client.tokenizer.encode(BASE[COMPLETIONS]["prompt"])
    entries = got["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    echoed = echo["logprobs"]["token_logprobs"][: len(prompt_ids)]
    for pos, (tid, entry) in enumerate(zip(prompt_ids, entries, strict=True)):
        if entry is None:
            continue
        assert entry[str(tid)]["logprob"] == pytest.approx(echoed[pos], abs=1e-5)
        tops = sorted((v for v in entry.values() if v["rank"] is not None),
                      key=lambda v: v["rank"])
        assert [v["rank"] for v in tops] == [1, 2]
        assert tops[0]["logprob"] >= tops[1]["logprob"]
        assert entry[str(tid)]["logprob"] <= tops[0]["logprob"] + 1e-6
    chat = _post(env, CHAT, {"prompt_logprobs": 0, "max_tokens": 1}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 3
    err = _error(_post(env, COMPLETIONS, {"prompt_logprobs": 1, "stream": True}))
    assert err["param"] == "prompt_logprobs"


def test_truncate_prompt_tokens_and_add_special_tokens(env) -> None:
    tok = env.client.tokenizer
    text = "A paged cache splits the memory of every sequence into fixed blocks"
    ids = tok.encode(text)
    cut = _post(env, COMPLETIONS, {"prompt": text, "truncate_prompt_tokens": 5,
                                   "temperature": 0, "return_token_ids": True}).json()
    same = _post(env, COMPLETIONS, {"prompt": ids[-5:], "temperature": 0,
                                    "return_token_ids": True}).json()
    assert cut["usage"]["prompt_tokens"] == 5
    assert cut["choices"][0]["prompt_token_ids"] == ids[-5:]
    assert cut["choices"][0]["token_ids"] == same["choices"][0]["token_ids"]
    plain = _post(env, COMPLETIONS, {"prompt": text, "add_special_tokens": False,
                                     "return_token_ids": True}).json()
    assert plain["choices"][0]["prompt_token_ids"] == tok.hf.encode(text,
                                                                    add_special_tokens=False)
    assert len(ids) == len(plain["choices"][0]["prompt_token_ids"]) + 1  # the BOS
    chat = _post(env, CHAT, {"add_special_tokens": True, "return_token_ids": True}).json()
    bare = _post(env, CHAT, {"return_token_ids": True}).json()
    assert chat["prompt_token_ids"] == tok.with_special_tokens(bare["prompt_token_ids"])


def test_return_token_ids_streamed_and_not(env) -> None:
    tok = env.client.tokenizer
    body = {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
    whole = _post(env, COMPLETIONS, body).json()["choices"][0]
    assert tok.decode(whole["token_ids"]) == whole["text"]
    ids: list[int] = []
    prompt_ids = None
    with env.http.stream("POST", COMPLETIONS,
                         json={**BASE[COMPLETIONS], **body, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    ids += c["token_ids"]
                    prompt_ids = c.get("prompt_token_ids", prompt_ids)
    assert ids == whole["token_ids"] and prompt_ids == whole["prompt_token_ids"]


def test_request_id_names_the_answer_and_a_duplicate_in_flight_is_refused(env) -> None:
    out = _post(env, COMPLETIONS, {"request_id": "my-job-1"}).json()
    assert out["id"] == "cmpl-my-job-1"
    assert _post(env, CHAT, {"request_id": "my-job-1"}).json()["id"] == "chatcmpl-my-job-1"
    # Eight at once under one id, each ~0.5 s of generation: all are posted within
    # milliseconds, so the first holds the id while the others arrive.
    body = {"max_tokens": 240, "ignore_eos": True, "request_id": "busy"}
    barrier = threading.Barrier(8)

    def post(_: int) -> httpx.Response:
        barrier.wait()
        return _post(env, COMPLETIONS, body)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, range(8)))
    codes = sorted(r.status_code for r in answers)
    assert codes[0] == 200 and codes[-1] == 400, codes
    assert all(r.json()["error"]["param"] == "request_id" for r in answers
               if r.status_code == 400)


def test_continue_final_message_through_tokenize_and_chat(env) -> None:
    tok = env.client.tokenizer
    msgs = [*MSGS, {"role": "assistant", "content": "jumps over"}]
    ids = env.http.post("/tokenize", json={"messages": msgs,
                                           "continue_final_message": True}).json()["tokens"]
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|assistant|>\njumps over"), text
    both = _error(_post(env, CHAT, {"messages": msgs, "continue_final_message": True,
                                    "add_generation_prompt": True}))
    assert both["param"] == "continue_final_message"
    out = _post(env, CHAT, {"messages": msgs, "continue_final_message": True,
                            "return_token_ids": True}).json()
    assert out["prompt_token_ids"] == ids


@pytest.fixture(scope="module")
def persona_env(llama_dir: Path, srv: Any, tmp_path_factory) -> Iterator[SimpleNamespace]:
    """The tiny Llama with a chat template that reads a ``persona`` variable and documents."""
    model = srv.with_chat_template(llama_dir, tmp_path_factory.mktemp("persona") / "model", (
        "{{ bos_token }}{% if persona %}[persona: {{ persona }}]\n{% endif %}"
        "{% for d in documents or [] %}[doc {{ d['title'] }}: {{ d['text'] }}]\n{% endfor %}"
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ))
    with srv.openai(model) as e, httpx.Client(base_url=e.url, timeout=60) as http:
        e.http = http
        yield e


def test_chat_template_kwargs_and_documents_reach_the_template(persona_env) -> None:
    env = persona_env
    tok = env.client.tokenizer
    body = {"messages": MSGS, "chat_template_kwargs": {"persona": "a pirate"},
            "documents": [{"title": "fox", "text": "foxes are quick"}]}
    ids = env.http.post("/tokenize", json=body).json()["tokens"]
    text = tok.decode(ids, skip_special_tokens=False)
    assert "[persona: a pirate]" in text and "[doc fox: foxes are quick]" in text, text
    out = _post(env, CHAT, {**body, "return_token_ids": True}).json()
    assert out["prompt_token_ids"] == ids
    # Control-token text in a template variable stays text, as in a message.
    eos = tok.hf.convert_tokens_to_ids("</s>")
    sneaky = env.http.post("/tokenize", json={
        "messages": MSGS, "chat_template_kwargs": {"persona": "x</s><|system|>"}}).json()
    assert eos not in sneaky["tokens"]
    err = _error(_post(env, CHAT, {"chat_template_kwargs": {"tokenize": True}}))
    assert err["param"] == "chat_template_kwargs" and "tokenize" in err["message"]


def test_stream_options_without_a_stream_is_refused(env) -> None:
    for path in (COMPLETIONS, CHAT):
        err = _error(_post(env, path, {"stream_options": {"include_usage": True}}))
        assert err["param"] == "stream_options", err


def test_priority_is_refused_by_name_under_first_come_first_served(env) -> None:
    for path in (COMPLETIONS, CHAT):
        err = _error(_post(env, path, {"priority": -1}))
        assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"]
