"""The JSONL generate job (serving/jsonl_job/job.py) on a tiny checkpoint.

One in-process engine (the ``local`` backend: no Ray) serves most cases, as ``run_job`` takes
any ``EngineClient``; the command-line path starts its own, also local. Greedy sampling with
``ignore_eos`` keeps every output deterministic, so a restarted job must write exactly what an
uninterrupted one writes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from helpers.checkpoints import make_checkpoint

from pagedserve.builder import start_engine
from pagedserve.config import from_flat
from pagedserve.messages import SamplingParams
from pagedserve.serving.cli.generate import add_generate_arguments, run_generate_job
from pagedserve.serving.jsonl_job.job import nothing_left, run_job
from pagedserve.serving.jsonl_job.lines import id_key

MAX_MODEL_LEN = 96
ENGINE = {"max_model_len": MAX_MODEL_LEN, "num_gpu_blocks": 128, "block_size": 16}
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama")


@pytest.fixture(scope="module")
def client(ckpt: Path):
    c = start_engine(from_flat(model=str(ckpt), **ENGINE), backend="local")
    yield c
    c.shutdown()


def _write(path: Path, lines: list[Any]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(t) for t in path.read_text(encoding="utf-8").splitlines() if t.strip()]


def _by_id(path: Path) -> dict[str, dict[str, Any]]:
    recs = _records(path)
    by = {id_key(r["id"]): r for r in recs}
    assert len(by) == len(recs), f"an id was written twice: {[r['id'] for r in recs]}"
    return by


def test_mixed_valid_and_malformed_lines(client, tmp_path: Path, capsys) -> None:
    lines = [
        {"id": "a", "prompt": "Hello, world!"},                          # 1 ok
        '{"id": "b", "prompt": "unterminated',                           # 2 bad JSON
        {"id": "c", "max_tokens": 4},                                     # 3 no prompt
        {"id": "d", "prompt": "x", "temperature": -1},                    # 4 bad sampling value
        {"id": "e", "prompt_token_ids": [5] * (MAX_MODEL_LEN + 10)},      # 5 prompt too long
        {"id": "f", "prompt_token_ids": [5, 100000, 7]},                  # 6 token id out of vocab
        {"id": "g", "prompt_token_ids": [5, "x"]},                        # 7 ids not integers
        "",                                                               # blank: not a request
        {"id": "h", "prompt": "The quick brown fox", "max_tokn": 3},     # 9 unknown field
        {"id": "a", "prompt": "again"},                                   # 10 duplicate id
        {"prompt_token_ids": [3, 4, 5, 6]},                               # 11 ok, id = line 11
        [1, 2, 3],                                                        # 12 not an object
    ]
    inp = _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    summary = run_job(client, str(inp), str(out), GREEDY, max_in_flight=2,
                      progress="log", log_every_s=0.0)
    recs = _records(out)
    ok = {json.dumps(r["id"]) for r in recs if "error" not in r}
    errors = {r["line"]: r for r in recs if "error" in r}
    assert ok == {'"a"', "11"}
    assert sorted(errors) == [2, 3, 4, 5, 6, 7, 9, 10, 12]
    assert errors[2]["id"] == 2 and "JSON" in errors[2]["error"]
    assert "prompt" in errors[3]["error"]
    assert "temperature" in errors[4]["error"]
    assert errors[5]["error_type"] == "PromptTooLongError"
    assert errors[6]["error_type"] == "InvalidTokenError"
    assert "integers" in errors[7]["error"]
    assert "max_tokn" in errors[9]["error"]
    assert "duplicate" in errors[10]["error"] and errors[10]["id"] == "a"
    assert summary.total == 11 and summary.succeeded == 2 and summary.failed == 9
    assert summary.exit_status == 9
    good = next(r for r in recs if r["id"] == "a" and "error" not in r)
    assert good["prompt"] == "Hello, world!"
    assert len(good["token_ids"]) == 6 and good["finish_reason"] == "length"
    assert good["usage"]["prompt_tokens"] == len(client.tokenizer.encode("Hello, world!"))
    assert good["usage"]["completion_tokens"] == 6
    assert "done" in capsys.readouterr().err  # plain log lines when stderr is not a terminal


def test_per_line_overrides_and_chat(client, tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    inp = _write(tmp_path / "in.jsonl", [
        {"id": 1, "prompt": "The lazy dog", "max_tokens": 3},
        {"id": 2, "prompt": "The lazy dog"},
        {"id": 3, "messages": messages, "max_tokens": 5, "stop": ["\u0000never"]},
        {"id": 4, "prompt": "The lazy dog", "metadata": {"k": [1, 2]}},
    ])
    out = tmp_path / "out.jsonl"
    summary = run_job(client, str(inp), str(out), GREEDY, max_in_flight=8, progress="none")
    assert summary.exit_status == 0 and summary.succeeded == 4
    by = {r["id"]: r for r in _records(out)}
    assert len(by[1]["token_ids"]) == 3
    assert len(by[2]["token_ids"]) == GREEDY["max_tokens"]
    assert by[1]["token_ids"] == by[2]["token_ids"][:3]  # greedy: a prefix of the longer run
    assert by[4]["metadata"] == {"k": [1, 2]}
    hf = client.tokenizer.hf
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|assistant|>" in rendered
    assert by[3]["usage"]["prompt_tokens"] == len(hf.encode(rendered, add_special_tokens=False))
    assert len(by[3]["token_ids"]) == 5 and "error" not in by[3]


def test_openai_batch_lines(client, tmp_path: Path) -> None:
    """The Batch API's line format: custom_id is the id and stays in the record; a rerun
    skips the custom_ids already written."""
    messages = [{"role": "user", "content": "Hi!"}]
    lines: list[Any] = [
        {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
         "body": {"model": "any", "prompt": "The lazy dog", "max_tokens": 3}},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": messages, "max_completion_tokens": 4}},
        {"custom_id": "ids", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": [5, 6, 7]}},
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}},
        {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "again"}},
    ]
    inp = _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    summary = run_job(client, str(inp), str(out), GREEDY, progress="none")
    assert (summary.succeeded, summary.failed) == (3, 2)
    recs = _records(out)
    ok = {r["custom_id"]: r for r in recs if "error" not in r}
    assert sorted(ok) == ["chat", "cmpl", "ids"] and all(r["id"] == k for k, r in ok.items())
    assert len(ok["cmpl"]["token_ids"]) == 3 and ok["cmpl"]["prompt"] == "The lazy dog"
    assert len(ok["chat"]["token_ids"]) == 4
    assert len(ok["ids"]["token_ids"]) == GREEDY["max_tokens"]
    errors = {r["line"]: r for r in recs if "error" in r}
    assert errors[4]["id"] == "bad-url" and "url" in errors[4]["error"]
    assert errors[5]["id"] == "cmpl" and "duplicate" in errors[5]["error"]
    again = run_job(client, str(inp), str(out), GREEDY, progress="none")
    assert again.skipped == 5 and again.succeeded == 0 and len(_records(out)) == 5


def test_n_greater_than_one(client, tmp_path: Path) -> None:
    inp = _write(tmp_path / "in.jsonl", [
        {"id": "s", "prompt": "Once upon a time", "n": 3, "temperature": 1.0, "seed": 7},
    ])
    out = tmp_path / "out.jsonl"
    assert run_job(client, str(inp), str(out), GREEDY, progress="none").exit_status == 0
    (rec,) = _records(out)
    assert [c["index"] for c in rec["choices"]] == [0, 1, 2]
    assert all(len(c["token_ids"]) == 6 for c in rec["choices"])
    assert rec["text"] == rec["choices"][0]["text"]
    assert rec["usage"]["completion_tokens"] == 18
    assert len({tuple(c["token_ids"]) for c in rec["choices"]}) > 1  # sampled, not copies


def test_restart_skips_done_ids(client, tmp_path: Path) -> None:
    lines: list[Any] = [{"id": f"r{i}", "prompt": f"Numbers: {i} {i + 1}"} for i in range(8)]
    lines.insert(3, {"id": "bad", "prompt": "x", "top_p": 0})
    inp = _write(tmp_path / "in.jsonl", lines)
    full = tmp_path / "full.jsonl"
    assert run_job(client, str(inp), str(full), GREEDY, progress="none").failed == 1
    reference = _by_id(full)
    assert len(reference) == 9

    # A job killed halfway: three whole records (one of them the error) and a torn fourth.
    raw = full.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in raw if '"bad"' in line] + [
        line for line in raw if '"bad"' not in line][:2]
    partial = tmp_path / "partial.jsonl"
    torn = next(line for line in raw if line not in kept)
    partial.write_text("".join(kept) + torn[: len(torn) // 2], encoding="utf-8")

    assert nothing_left(str(inp), str(partial)) is None
    summary = run_job(client, str(inp), str(partial), GREEDY, progress="none")
    assert summary.skipped == 3 and summary.succeeded == 6 and summary.failed == 0
    assert summary.exit_status == 0
    resumed = _by_id(partial)  # every id exactly once, the torn line gone
    assert set(resumed) == set(reference)
    for key, rec in reference.items():
        assert resumed[key].get("token_ids") == rec.get("token_ids"), key
        assert resumed[key].get("error") == rec.get("error"), key

    # A third run has nothing left to do, and the command knows before starting an engine.
    again = run_job(client, str(inp), str(partial), GREEDY, progress="none")
    assert again.skipped == 9 and again.succeeded == again.failed == 0
    assert len(_records(partial)) == 9
    left = nothing_left(str(inp), str(partial))
    assert left is not None and (left.total, left.skipped, left.exit_status) == (9, 9, 0)


def test_greedy_text_equals_llm(client, ckpt: Path, tmp_path: Path) -> None:
    from pagedserve import LLM

    prompts = ["Hello, my name is", "def add(a, b):"]
    inp = _write(tmp_path / "in.jsonl", [{"id": i, "prompt": p} for i, p in enumerate(prompts)])
    out = tmp_path / "out.jsonl"
    run_job(client, str(inp), str(out), {**GREEDY, "max_tokens": 10}, progress="none")
    by = {r["id"]: r for r in _records(out)}
    with LLM(str(ckpt), backend="local", **ENGINE) as llm:
        direct = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0,
                                                      ignore_eos=True), use_tqdm=False)
    for i, o in enumerate(direct):
        assert by[i]["token_ids"] == o.outputs[0].token_ids
        assert by[i]["text"] == o.outputs[0].text


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedserve generate")
    add_generate_arguments(parser)
    return parser.parse_args(argv)


def test_command_exit_status_and_plain_prompts(
    ckpt: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDSERVE_BACKEND", "local")
    inp = _write(tmp_path / "in.jsonl", [
        {"id": "ok", "prompt": "Hello"},
        "not json",
        {"id": "long", "prompt_token_ids": [4] * 500},
    ])
    out = tmp_path / "out.jsonl"
    engine = ["--model", str(ckpt), "--max-model-len", str(MAX_MODEL_LEN),
              "--num-gpu-blocks", "128", "--max-tokens", "4", "--ignore-eos"]
    status = run_generate_job(_parse([*engine, "--input", str(inp), "--output", str(out),
                                      "--max-in-flight", "4", "--progress", "none"]))
    assert status == 2
    assert "2 failed" in capsys.readouterr().err
    assert len(_records(out)) == 3

    # No --input: today's form, completions on stdout.
    status = run_generate_job(_parse([*engine, "--prompt", "Hello", "--prompt", "Bye", "--json"]))
    assert status == 0
    printed = [json.loads(t) for t in capsys.readouterr().out.splitlines()]
    assert [p["prompt"] for p in printed] == ["Hello", "Bye"]
    assert all(len(p["token_ids"]) == 4 for p in printed)

    assert run_generate_job(_parse(["--input", str(inp)])) == 2  # --output is required
