"""The online Batch API with the official ``openai`` client, on a real uvicorn server over the
tiny checkpoint: upload, create, poll, download, list, cancel, errors, and a resume."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx2 as httpx
import jsonschema
import openai
import pytest

from pagedserve.serving.openai.server import build_app

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _line(cid: str, body: dict[str, Any], url: str = "/v1/completions") -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


@pytest.fixture(scope="module")
def env(llama_dir, srv, tmp_path_factory) -> Iterator[SimpleNamespace]:
    from openai import OpenAI

    tmp = tmp_path_factory.mktemp("batch-api")
    client = srv.start_client(llama_dir, max_model_len=128)
    app = build_app(client, batch_dir=tmp / "batches")
    try:
        with srv.running(app) as url:
            oai = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            yield SimpleNamespace(client=client, oai=oai, url=url, tmp=tmp, srv=srv,
                                  model=client.model_name)
            oai.close()
    finally:
        app.state.batches.close()
        client.shutdown()


def _upload(env, lines: list[Any], name: str = "in.jsonl") -> str:
    path = env.tmp / name
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    with open(path, "rb") as f:
        return env.oai.files.create(file=f, purpose="batch").id


def _run(env, lines: list[Any], endpoint: str = "/v1/completions", **kw: Any) -> Any:
    batch = env.oai.batches.create(input_file_id=_upload(env, lines), endpoint=endpoint,
                                   completion_window="24h", **kw)
    assert batch.status == "validating" and batch.object == "batch"
    assert env.srv.wait_until(
        lambda: env.oai.batches.retrieve(batch.id).status in ("completed", "failed"), 120)
    return env.oai.batches.retrieve(batch.id)


def _records(env, file_id: str | None) -> dict[str | None, list[dict[str, Any]]]:
    if file_id is None:
        return {}
    by: dict[str | None, list[dict[str, Any]]] = {}
    for text in env.oai.files.content(file_id).text.splitlines():
        rec = json.loads(text)
        by.setdefault(rec["custom_id"], []).append(rec)
    return by


def test_completions_batch_answers_as_the_endpoint_does(env) -> None:
    bodies = {f"c{i}": {"model": env.model, "prompt": f"Line {i}", "max_tokens": 4 + i, **GREEDY}
              for i in range(4)}
    bodies["ids"] = {"prompt": [1, 5, 9, 14], "max_tokens": 3, **GREEDY}
    batch = _run(env, [_line(cid, body) for cid, body in bodies.items()],
                 metadata={"job": "nightly"})
    assert batch.status == "completed" and batch.metadata == {"job": "nightly"}
    assert batch.request_counts.total == 5 and batch.request_counts.completed == 5
    assert batch.request_counts.failed == 0 and batch.error_file_id is None
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    assert batch.expires_at == batch.created_at + 24 * 3600
    assert batch.failed_at is None and batch.cancelled_at is None
    out = _records(env, batch.output_file_id)
    assert sorted(out) == sorted(bodies) and all(len(v) == 1 for v in out.values())
    usage = {"prompt": 0, "completion": 0}
    for cid, body in bodies.items():
        (rec,) = out[cid]
        assert rec["error"] is None and rec["id"].startswith("batch_req_")
        resp = rec["response"]
        assert resp["status_code"] == 200 and resp["request_id"] == resp["body"]["id"]
        direct = httpx.post(f"{env.url}/v1/completions", json=body, timeout=60).json()
        for key in ("object", "model", "choices"):
            assert resp["body"][key] == direct[key], key
        assert resp["body"]["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
        usage["prompt"] += resp["body"]["usage"]["prompt_tokens"]
        usage["completion"] += resp["body"]["usage"]["completion_tokens"]
    assert batch.usage.input_tokens == usage["prompt"]
    assert batch.usage.output_tokens == usage["completion"]
    meta = env.oai.files.retrieve(batch.output_file_id)
    assert meta.purpose == "batch_output" and meta.bytes > 0


def test_chat_batch_answers_as_the_endpoint_does(env) -> None:
    body = {"messages": [{"role": "user", "content": "Hello there"}],
            "max_completion_tokens": 6, **GREEDY}
    batch = _run(env, [_line("chat-1", body, "/v1/chat/completions")],
                 endpoint="/v1/chat/completions")
    (rec,) = _records(env, batch.output_file_id)["chat-1"]
    direct = httpx.post(f"{env.url}/v1/chat/completions", json=body, timeout=60).json()
    assert rec["response"]["body"]["object"] == "chat.completion"
    assert rec["response"]["body"]["choices"] == direct["choices"]


def test_constrained_lines_validate_and_a_bad_schema_fails_alone(env) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    enum = {"enum": ["left", "right"]}  # guided_json cannot be compact: no room for whitespace
    chat = {"messages": [{"role": "user", "content": "A record"}], "temperature": 1.0,
            "max_completion_tokens": 48}
    # Compact JSON: a random model, free to add whitespace, rarely stops adding it.
    compact = {"structured_outputs": {"disable_any_whitespace": True}}

    def fmt(s: dict[str, Any]) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": "rec", "schema": s}}

    bodies = {
        "fmt": {**chat, "seed": 1, "n": 2, "response_format": fmt(schema), **compact},
        "so": {**chat, "seed": 2, "structured_outputs": {"json": schema,
                                                         "disable_any_whitespace": True}},
        "guided": {**chat, "seed": 3, "guided_json": enum},
        "bad": {**chat, "response_format": fmt({"type": "object", "minProperties": "two"})},
        "plain": {**chat, "max_completion_tokens": 3},
    }
    lines = [_line(cid, body, "/v1/chat/completions") for cid, body in bodies.items()]
    batch = _run(env, lines, endpoint="/v1/chat/completions")
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 1)
    out, err = _records(env, batch.output_file_id), _records(env, batch.error_file_id)
    for cid, want in (("fmt", schema), ("so", schema), ("guided", enum)):
        choices = out[cid][0]["response"]["body"]["choices"]
        assert len(choices) == bodies[cid].get("n", 1)
        for choice in choices:
            assert choice["finish_reason"] == "stop"
            jsonschema.validate(json.loads(choice["message"]["content"]), want)
    (rec,) = err["bad"]
    assert rec["response"]["status_code"] == 400
    assert rec["response"]["body"]["error"]["param"] == "response_format"
    assert "minProperties" in rec["error"]["message"]


def test_responses_lines_answer_as_the_endpoint_does(env) -> None:
    from openai.types.responses import Response

    record = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    text = {"input": "Hello there", "max_output_tokens": 6, "temperature": 0.0}
    bodies = {
        "text": text,
        "fmt": {"input": "A record.", "temperature": 1.0, "max_output_tokens": 48,
                "text": {"format": {"type": "json_schema", "name": "rec", "schema": record,
                                    "strict": True}}},
        "empty": {"input": []},  # refused as /v1/responses refuses it, naming input
    }
    lines = [_line(cid, body, "/v1/responses") for cid, body in bodies.items()]
    batch = _run(env, lines, endpoint="/v1/responses")
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    out, err = _records(env, batch.output_file_id), _records(env, batch.error_file_id)
    answers = {cid: Response.model_validate(out[cid][0]["response"]["body"])
               for cid in ("text", "fmt")}
    for cid, resp in answers.items():
        assert resp.object == "response" and resp.id.startswith("resp_")
        assert out[cid][0]["response"]["request_id"] == resp.id
    direct = Response.model_validate(
        httpx.post(f"{env.url}/v1/responses", json=text, timeout=60).json())
    got = answers["text"]
    assert (got.output_text, got.status, got.usage.output_tokens) == (
        direct.output_text, direct.status, direct.usage.output_tokens)
    assert got.usage.output_tokens > 0
    assert answers["fmt"].status == "completed"  # the constrained record ends itself
    assert answers["fmt"].text.format.type == "json_schema"
    jsonschema.validate(json.loads(answers["fmt"].output_text), record)
    (rec,) = err["empty"]
    assert rec["response"]["status_code"] == 400
    assert rec["response"]["body"]["error"]["param"] == "input"


def test_malformed_lines_get_errors_and_the_batch_goes_on(env) -> None:
    ok = {"prompt": "fine", "max_tokens": 2}
    lines: list[Any] = [
        _line("good-1", ok),
        "{this is not json",
        {"method": "POST", "url": "/v1/completions", "body": ok},  # no custom_id
        _line("good-1", ok),  # a repeat
        _line("chat-url", ok, "/v1/chat/completions"),
        {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": ok},
        _line("not-object", "prompt"),  # type: ignore[arg-type]
        _line("bad-type", {"prompt": "x", "max_tokens": "many"}),
        _line("bad-value", {"prompt": "x", "temperature": -1.0}),
        _line("too-long", {"prompt": "x" * 400, "max_tokens": 2}),
        _line("other-model", {"model": "gpt-4", "prompt": "x"}),
        _line("stream", {"prompt": "x", "stream": True}),
        _line("good-2", ok),
    ]
    batch = _run(env, lines)
    assert batch.status == "completed"
    assert batch.request_counts.total == 13
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 11)
    out, err = _records(env, batch.output_file_id), _records(env, batch.error_file_id)
    assert sorted(out) == ["good-1", "good-2"] and len(out["good-1"]) == 1
    envelope = {None: ["invalid_json", "missing_custom_id"], "good-1": ["duplicate_custom_id"],
                "chat-url": ["invalid_url"], "get": ["invalid_method"],
                "not-object": ["invalid_body"]}
    for cid, codes in envelope.items():
        assert sorted(r["error"]["code"] for r in err[cid]) == codes, cid
        assert all(r["response"] is None and r["error"]["message"] for r in err[cid])
    # Bodies the endpoint refuses: its status and error body, as over HTTP.
    expect = {"bad-type": (400, "max_tokens"), "bad-value": (400, "temperature"),
              "too-long": (400, "prompt"), "other-model": (404, "model"),
              "stream": (400, "stream")}
    for cid, (status, param) in expect.items():
        (rec,) = err[cid]
        assert rec["response"]["status_code"] == status, cid
        assert rec["response"]["body"]["error"]["param"] == param, cid
        assert rec["error"]["message"] == rec["response"]["body"]["error"]["message"]
    direct = httpx.post(f"{env.url}/v1/completions", json={"prompt": "x", "max_tokens": "many"})
    assert err["bad-type"][0]["response"]["body"] == direct.json()


def test_list_pages_newest_first(env) -> None:
    file_id = _upload(env, [_line("x", {"prompt": "a", "max_tokens": 1})], "small.jsonl")
    made = [env.oai.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                   completion_window="24h").id for _ in range(3)]
    first = env.oai.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    second = env.oai.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == made[0]
    every = [b.id for b in env.oai.batches.list(limit=2)]  # the client follows the cursor
    assert every[:3] == made[::-1] and len(every) == len(set(every))
    assert env.srv.wait_until(lambda: all(
        env.oai.batches.retrieve(b).status == "completed" for b in made), 60)


def test_cancel_a_running_batch(env) -> None:
    lines = [_line(f"long-{i}", {"prompt": f"Story {i}", "max_tokens": 40, **GREEDY})
             for i in range(30)]
    batch = env.oai.batches.create(input_file_id=_upload(env, lines, "long.jsonl"),
                                   endpoint="/v1/completions", completion_window="24h")
    assert env.srv.wait_until(
        lambda: env.oai.batches.retrieve(batch.id).request_counts.completed >= 1, 60)
    cancelling = env.oai.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    assert env.srv.wait_until(
        lambda: env.oai.batches.retrieve(batch.id).status == "cancelled", 60)
    done = env.oai.batches.retrieve(batch.id)
    assert done.cancelled_at >= done.cancelling_at and done.completed_at is None
    out = _records(env, done.output_file_id)
    assert 1 <= len(out) == done.request_counts.completed < 30
    assert env.oai.batches.cancel(batch.id).status == "cancelled"  # idempotent
    with pytest.raises(openai.ConflictError):
        finished = _run(env, [_line("q", {"prompt": "a", "max_tokens": 1})])
        env.oai.batches.cancel(finished.id)


def test_an_empty_input_fails_the_batch(env) -> None:
    batch = _run(env, [""])
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.errors.data[0].code == "empty_file"


def test_bad_requests_get_openai_errors(env) -> None:
    file_id = _upload(env, [_line("x", {"prompt": "a", "max_tokens": 1})], "e.jsonl")
    create = dict(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        env.oai.batches.create(**{**create, "input_file_id": "file-nope"})
    for bad in ({"endpoint": "/v1/embeddings"}, {"completion_window": "48h"},
                {"metadata": {f"k{i}": "v" for i in range(17)}}):
        with pytest.raises(openai.BadRequestError) as info:
            env.oai.batches.create(**{**create, **bad})  # type: ignore[arg-type]
        assert info.value.body["param"] == next(iter(bad))  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        env.oai.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        env.oai.files.content("file-nope")
    with pytest.raises(openai.BadRequestError):
        env.oai.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
    raw = httpx.post(f"{env.url}/v1/files", data={"purpose": "batch"})  # no file part
    assert raw.status_code == 400 and set(raw.json()["error"]) == {
        "message", "type", "param", "code"}
    raw = httpx.post(f"{env.url}/v1/batches", json={"input_file_id": 3})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "input_file_id"


def test_files_list_retrieve_and_delete(env) -> None:
    file_id = _upload(env, [_line("d", {"prompt": "a", "max_tokens": 1})], "d.jsonl")
    meta = env.oai.files.retrieve(file_id)
    assert meta.filename == "d.jsonl" and meta.purpose == "batch" and meta.status == "processed"
    assert file_id in [f.id for f in env.oai.files.list(purpose="batch")]
    assert env.oai.files.content(file_id).text.startswith('{"custom_id": "d"')
    assert env.oai.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        env.oai.files.retrieve(file_id)


def test_a_stopped_server_resumes_its_batch(llama_dir, srv, tmp_path: Path) -> None:
    """Stop the runner mid-batch (lines in flight are not written), leave a torn last record
    as a kill would, start a new app on the same directory: every line is answered once and
    the records written before stay as they were."""
    from openai import OpenAI

    # The lines after the first three are long (ignore_eos: 96 tokens each), so the runner
    # cannot finish the other nine between the poll that sees three done and the stop.
    lines = [_line(f"r{i}", {"prompt": f"Resume {i}", "max_tokens": 16 if i < 3 else 96,
                             **GREEDY}) for i in range(12)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    client = srv.start_client(llama_dir, max_model_len=128)
    try:
        first = build_app(client, batch_dir=tmp_path / "b", batch_max_in_flight=2)
        with srv.running(first) as url, OpenAI(base_url=f"{url}/v1", api_key="x") as oai:
            with open(src, "rb") as f:
                file_id = oai.files.create(file=f, purpose="batch").id
            batch = oai.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                       completion_window="24h")
            assert srv.wait_until(
                lambda: oai.batches.retrieve(batch.id).request_counts.completed >= 3, 60)
            first.state.batches.close()
        state = json.loads((tmp_path / "b" / "batches" / f"{batch.id}.json").read_text())
        assert state["batch"]["status"] == "in_progress"
        out_path = tmp_path / "b" / "files" / f"{state['state']['output_file_id']}.jsonl"
        before = out_path.read_text().splitlines()
        assert 3 <= len(before) < 12
        with open(out_path, "a") as f:
            f.write('{"id": "batch_req_torn", "custom_id": "r11", "resp')
        second = build_app(client, batch_dir=tmp_path / "b")
        try:
            with srv.running(second) as url, OpenAI(base_url=f"{url}/v1", api_key="x") as oai:
                assert srv.wait_until(
                    lambda: oai.batches.retrieve(batch.id).status == "completed", 120)
                done = oai.batches.retrieve(batch.id)
                text = oai.files.content(done.output_file_id).text
        finally:
            second.state.batches.close()
    finally:
        client.shutdown()
    after = text.splitlines()
    assert after[:len(before)] == before
    ids = [json.loads(t)["custom_id"] for t in after]
    assert sorted(ids) == sorted(f"r{i}" for i in range(12))
    assert done.request_counts.completed == 12 and done.error_file_id is None
