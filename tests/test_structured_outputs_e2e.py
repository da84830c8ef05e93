"""Structured outputs end to end, in-process, on a tiny random Llama: whatever the sampler
draws, every finished output satisfies its constraint (checked with ``jsonschema`` and
``re``, references nobody here wrote), through chunked prefill, preemption by recompute,
prefix-cache hits and ``n > 1``; and greedy decoding under a constraint that admits the
model's own answer gives that answer token for token."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from helpers.checkpoints import make_checkpoint
from helpers.schemas import BOUNDED_SCHEMAS

from pagedserve import LLM, SamplingParams
from pagedserve.controller.errors import InvalidGrammarError
from pagedserve.messages import StructuredOutputsParams as Constraint

SCHEMAS = BOUNDED_SCHEMAS
REGEX = r"[0-9]{3}-[a-z]{2}(!|\?)"
CHOICES = ["yes", "no", "it depends"]
PROMPTS = [[5, 6, 7], list(range(10, 60)), [300, 301], list(range(100, 133))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", Path(tmp_path_factory.mktemp("so")) / "llama")


@pytest.fixture(scope="module")
def llm(checkpoint: Path):
    path = checkpoint
    # Small blocks, a small budget and a small pool: long prompts are chunked and decoding
    # requests get preempted (recompute) while the constraints hold.
    engine = LLM(str(path), backend="local", block_size=4, num_gpu_blocks=40,
                 max_num_batched_tokens=24, max_num_seqs=8)
    yield engine
    engine.shutdown()


def _json(schema: dict, **kw) -> SamplingParams:
    return SamplingParams(
        max_tokens=96, temperature=1.0,
        structured_outputs=Constraint(json=schema, disable_any_whitespace=True), **kw)


def _valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_sampled_json_always_follows_its_schema(llm) -> None:
    params, schemas = [], []
    for i, schema in enumerate(SCHEMAS):
        for seed in range(3):
            params.append(_json(schema, seed=100 * i + seed))
            schemas.append(schema)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, schema in zip(outs, schemas, strict=True):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", (comp.text, schema)
        _valid(comp.text, schema)
    assert llm.stats()["num_preemptions"] > 0  # the constraints held through preemption


def test_n_gt_1_each_completion_its_own_matcher(llm) -> None:
    schema = SCHEMAS[0]
    (out,) = llm.generate([PROMPTS[1]], _json(schema, n=4, seed=7), use_tqdm=False)
    texts = [c.text for c in out.outputs]
    assert len(texts) == 4 and len(set(texts)) > 1
    for c in out.outputs:
        assert c.finish_reason == "stop"
        _valid(c.text, schema)


def test_regex_choice_grammar_and_json_object(llm) -> None:
    lark = 'start: "(" num ("," num)* ")"\nnum: /[1-9][0-9]?/'
    gbnf = 'root ::= "<" [a-c]+ ">"'
    cases = [
        (Constraint(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
        (Constraint(choice=CHOICES), lambda t: t in CHOICES),
        (Constraint(grammar=lark), lambda t: re.fullmatch(r"\((?:[1-9][0-9]?,)*[1-9][0-9]?\)", t)),
        (Constraint(grammar=gbnf), lambda t: re.fullmatch(r"<[a-c]+>", t)),
    ]
    for seed in range(3):
        params = [SamplingParams(max_tokens=64, temperature=1.0, seed=seed, structured_outputs=c)
                  for c, _ in cases]
        outs = llm.generate([PROMPTS[seed]] * len(cases), params, use_tqdm=False)
        for out, (c, ok) in zip(outs, cases, strict=True):
            comp = out.outputs[0]
            assert comp.finish_reason == "stop" and ok(comp.text), (c, comp.text)


def test_any_json_object(llm) -> None:
    # Any object admits strings of any length, which a random model ends only by chance
    # (about 1 in 500 tokens is a quote): most run into the end of max_tokens inside a string,
    # and the grammar's completion is forced in the last tokens, so they still parse.
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=s, structured_outputs=Constraint(
        json_object=True, disable_any_whitespace=True)) for s in range(8)]
    outs = llm.generate([PROMPTS[s % 4] for s in range(8)], params, use_tqdm=False)
    for out in outs:
        comp = out.outputs[0]
        assert isinstance(json.loads(comp.text), dict), comp.text
        assert len(comp.token_ids) <= 48
    assert any(o.outputs[0].finish_reason == "length" for o in outs)


def test_a_budget_too_short_for_the_answer_still_ends_in_a_valid_document(llm) -> None:
    # Unbounded strings and digits, at budgets from what the smallest document takes to a few
    # times that: wherever the model stands when the tokens run short, the rest is forced.
    schema = {"type": "object", "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "code": {"type": "string", "pattern": "^[0-9]+-[a-z]+$"},
        "inner": {"type": "object", "properties": {"n": {"type": "number"}},
                  "required": ["n"]}},
        "required": ["title", "tags", "code", "inner"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=budget, temperature=1.0, seed=budget, n=2,
                             structured_outputs=Constraint(json=schema))
              for budget in (64, 80, 96, 112)]
    outs = llm.generate([PROMPTS[i % 4] for i in range(len(params))], params, use_tqdm=False)
    reasons = []
    for out, p in zip(outs, params, strict=True):
        for comp in out.outputs:
            _valid(comp.text, schema)
            assert len(comp.token_ids) <= p.max_tokens
            reasons.append(comp.finish_reason)
    assert "length" in reasons


def test_prefix_cache_hits_keep_the_constraint(llm) -> None:
    prompt = list(range(200, 248))  # 12 full blocks, cached by the first request
    first = llm.generate([prompt], _json(SCHEMAS[2], seed=1), use_tqdm=False)[0]
    second = llm.generate([prompt], _json(SCHEMAS[2], seed=2), use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    for out in (first, second):
        _valid(out.outputs[0].text, SCHEMAS[2])


def test_greedy_under_an_admitting_constraint_is_the_unconstrained_answer(
        llm, checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    # Answers the tokenizer itself would produce from their text: where a grammar forces bytes,
    # llguidance admits only their canonical tokenization (a model trained on canonical text
    # stays in distribution), so a random model's odd splits ("e" "re" as against "er") or
    # special tokens in the middle are not what such a constraint can reproduce.
    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    prompts = [[i, i + 1, i + 2] for i in range(20, 500, 7)]
    free = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    clean = [(p, o.outputs[0]) for p, o in zip(prompts, free, strict=True)
             if o.outputs[0].text.strip() and tok.encode(
                 o.outputs[0].text, add_special_tokens=False) == o.outputs[0].token_ids][:4]
    assert len(clean) >= 2
    for prompt, answer in clean:
        # Every token greedy picks keeps the answer inside the grammar, so the mask never
        # changes the choice, and the grammar ends the request where the answer ends.
        choices = ["zzz", answer.text, answer.text + "q"]
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                structured_outputs=Constraint(choice=choices))
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids[: len(answer.token_ids)] == answer.token_ids
        assert out.text in choices[1:]


def test_a_bad_constraint_is_refused_by_name(llm) -> None:
    bad = [Constraint(json={"type": "nope"}), Constraint(regex="[a-"),
           Constraint(grammar='start: "a" )')]
    for c in bad:
        with pytest.raises(InvalidGrammarError, match=f"structured_outputs.{c.kind}"):
            llm.generate([PROMPTS[0]], SamplingParams(structured_outputs=c), use_tqdm=False)
    # The engine serves on.
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) <= 3
