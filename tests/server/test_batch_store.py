"""The Batch API's disk state and line format, without an engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.serving.batch_api.records import DUPLICATE, LineTracker, job_fields, parse_line
from pagedserve.serving.batch_api.store import BatchStore, RecordFile, default_batch_dir

EP = "/v1/completions"


def _line(cid: object = "a", **over: object) -> str:
    obj = {"custom_id": cid, "method": "POST", "url": EP, "body": {"prompt": "hi"}, **over}
    return json.dumps(obj)


@pytest.mark.parametrize(
    ("text", "code", "custom_id"),
    [
        ("{not json", "invalid_json", None),
        ("[1, 2]", "invalid_request", None),
        (json.dumps({"method": "POST", "url": EP, "body": {}}), "missing_custom_id", None),
        (_line(cid=7), "missing_custom_id", None),
        (_line(cid=""), "missing_custom_id", None),
        (_line(method="GET"), "invalid_method", "a"),
        (_line(url="/v1/embeddings"), "invalid_url", "a"),
        (_line(body="prompt"), "invalid_body", "a"),
    ],
)
def test_malformed_envelopes(text: str, code: str, custom_id: str | None) -> None:
    line = parse_line(3, text, EP)
    assert line.error is not None and line.error[0] == code
    assert line.error[1].startswith("line 3: ")
    assert line.custom_id == custom_id


def test_a_good_line_keeps_its_body() -> None:
    line = parse_line(1, _line(body={"prompt": "x", "max_tokens": 2}), EP)
    assert line.error is None and line.custom_id == "a"
    assert line.body == {"prompt": "x", "max_tokens": 2}


def test_tracker_flags_repeats_and_skips_what_was_written() -> None:
    lines = [parse_line(i, t, EP) for i, t in enumerate(
        [_line("a"), _line("b"), _line("a"), "junk", _line("a"), "junk", _line("c")], start=1)]
    fresh = LineTracker([])
    assert [fresh.already_done(i, ln) for i, ln in enumerate(lines, start=1)] == [False] * 7
    assert [ln.error[0] if ln.error else None for ln in lines] == [
        None, None, DUPLICATE, "invalid_json", DUPLICATE, "invalid_json", None]
    # An earlier run wrote a, the first repeat of a, the first junk line and c.
    written = [("a", None), (None, "invalid_json"), ("a", DUPLICATE), ("c", None)]
    again = [parse_line(i, t, EP) for i, t in enumerate(
        [_line("a"), _line("b"), _line("a"), "junk", _line("a"), "junk", _line("c")], start=1)]
    resumed = LineTracker(written)
    done = [resumed.already_done(i, ln) for i, ln in enumerate(again, start=1)]
    assert done == [True, False, True, True, False, False, True]


def test_record_file_cuts_a_truncated_last_record(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    good = {"id": "r1", "custom_id": "a", "response": {"status_code": 200, "body": {
        "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                  "prompt_tokens_details": {"cached_tokens": 1}}}}, "error": None}
    path.write_text(json.dumps(good) + "\n" + '{"id": "r2", "custom_id": "b", "resp')
    rf = RecordFile(path)
    assert rf.keys == [("a", None)]
    assert rf.usage == {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 1}
    rf.append({"id": "r3", "custom_id": "c", "response": None,
               "error": {"code": "x", "message": "m"}})
    rf.close()
    recs = [json.loads(t) for t in path.read_text().splitlines()]
    assert [r["custom_id"] for r in recs] == ["a", "c"]
    assert RecordFile(path).keys == [("a", None), ("c", "x")]


def test_store_round_trips_through_a_restart(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    src = store.upload_path()
    src.write_text(_line() + "\n")
    meta = store.add_file(src, "in.jsonl", "batch")
    assert meta["bytes"] == len(_line()) + 1 and meta["object"] == "file"
    ids = [store.create_batch(meta["id"], EP, "24h", {"k": str(i)})["id"] for i in range(3)]
    store.transition(ids[0], {"validating"}, "in_progress")
    assert store.transition(ids[0], {"validating"}, "failed") is None  # not from in_progress
    again = BatchStore(tmp_path)
    assert again.get_file(meta["id"]) == meta
    b0 = again.get_batch(ids[0])
    assert b0["status"] == "in_progress" and b0["in_progress_at"] is not None
    assert b0["expires_at"] == b0["created_at"] + 24 * 3600
    assert again.active_batches() == ids  # oldest first
    page, more = again.list_batches(limit=2)
    assert [b["id"] for b in page] == ids[::-1][:2] and more
    page, more = again.list_batches(limit=2, after=page[-1]["id"])
    assert [b["id"] for b in page] == [ids[0]] and not more
    assert again.uses_file(meta["id"])
    assert not list(tmp_path.rglob("*.tmp"))


def test_default_dir_follows_xdg_and_is_made_on_first_use(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = default_batch_dir()
    assert root == tmp_path / "pagedserve" / "batches"
    store = BatchStore(root)
    assert not root.exists() and store.active_batches() == [] and store.list_files() == []
    store.upload_path()
    assert (root / "files").is_dir()


def test_job_fields_maps_openai_lines() -> None:
    chat = job_fields({"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                "max_completion_tokens": 5, "temperature": 0.0}})
    assert chat == {"id": "c1", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 5, "temperature": 0.0}
    ids = job_fields({"custom_id": "c2", "body": {"prompt": [1, 2], "max_tokens": 3}})
    assert ids == {"id": "c2", "prompt_token_ids": [1, 2], "max_tokens": 3}
    for bad in ({"custom_id": 3, "body": {}}, {"custom_id": "x", "body": []},
                {"custom_id": "x", "url": "/v1/embeddings", "body": {}},
                # The Batch API runs Responses lines; a generate job has no Responses endpoint.
                {"custom_id": "x", "url": "/v1/responses", "body": {"input": "hi"}}):
        with pytest.raises(ValueError):
            job_fields(bad)
