"""A ``pagedserve serve`` process killed mid-batch (SIGKILL) and started again on the same
``--batch-dir`` finishes the batch: every custom_id exactly once in the output, and every line
finished before the kill kept as it was."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2 as httpx

RUNNER = (
    "import argparse, sys\n"
    "from pagedserve.serving.cli.serve import add_serve_parser, run_serve\n"
    "p = argparse.ArgumentParser(); sub = p.add_subparsers(dest='command')\n"
    "add_serve_parser(sub)\n"
    "sys.exit(run_serve(p.parse_args(sys.argv[1:])))\n"
)
LINES = 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _poll(cond: Callable[[], bool], timeout: float, what: str,
          proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"the server exited ({proc.returncode}) before {what}:\n{out}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@contextmanager
def _server(model: Path, batch_dir: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = _free_port()
    cmd = [
        sys.executable, "-c", RUNNER, "serve", "--model", str(model), "--port", str(port),
        "--max-model-len", "128", "--kv-cache-memory-bytes", str(1 << 22),
        "--log-level", "warning", "--backend", "local", "--batch-dir", str(batch_dir),
        "--batch-max-in-flight", "2",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        _poll(up, 90, "the server came up", proc)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        if proc.stdout:
            proc.stdout.close()


def _complete_records(path: Path) -> list[str]:
    """The whole records of a file a kill may have torn (a last line cut short is dropped)."""
    if not path.exists():
        return []
    keep = []
    for text in path.read_text().splitlines(keepends=True):
        try:
            json.loads(text)
        except ValueError:
            break
        if text.endswith("\n"):
            keep.append(text.rstrip("\n"))
    return keep


def test_sigkill_mid_batch_then_restart_loses_no_line(llama_dir, tmp_path: Path) -> None:
    from openai import OpenAI

    batch_dir = tmp_path / "batches"
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({
        "custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
        "body": {"prompt": f"Request number {i}", "max_tokens": 24, "temperature": 0.0,
                 "ignore_eos": True},
    }) + "\n" for i in range(LINES)))

    with _server(llama_dir, batch_dir) as (url, proc):
        with OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30) as oai:
            with open(src, "rb") as f:
                file_id = oai.files.create(file=f, purpose="batch").id
            batch_id = oai.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                          completion_window="24h").id
            _poll(lambda: oai.batches.retrieve(batch_id).request_counts.completed >= 5, 120,
                  "5 finished lines", proc)
        proc.kill()  # SIGKILL: no clean-up of any kind
        proc.wait(timeout=30)

    doc: dict[str, Any] = json.loads((batch_dir / "batches" / f"{batch_id}.json").read_text())
    assert doc["batch"]["status"] == "in_progress", "the batch finished before the kill"
    out_path = batch_dir / "files" / f"{doc['state']['output_file_id']}.jsonl"
    before = _complete_records(out_path)
    assert 5 <= len(before) < LINES

    with _server(llama_dir, batch_dir) as (url, proc):
        with OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30) as oai:
            _poll(lambda: oai.batches.retrieve(batch_id).status == "completed", 300,
                  "the resumed batch to complete", proc)
            batch = oai.batches.retrieve(batch_id)
            output = oai.files.content(batch.output_file_id).text.splitlines()

    assert batch.request_counts.total == LINES
    assert batch.request_counts.completed == LINES and batch.request_counts.failed == 0
    assert batch.error_file_id is None
    assert output[:len(before)] == before  # every line finished before the kill, kept
    ids = [json.loads(t)["custom_id"] for t in output]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(LINES))  # each exactly once
    for text in output:
        rec = json.loads(text)
        assert rec["response"]["status_code"] == 200
        assert rec["response"]["body"]["usage"]["completion_tokens"] == 24
