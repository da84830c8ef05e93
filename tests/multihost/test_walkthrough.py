"""deploy/README.md walked through as written, on the test hosts: the cluster itself was
started by its ``head`` and ``worker`` blocks (with token authentication, the token file copied
from the head to the worker as the README says); here its ``generate``, ``serve`` and
``client`` blocks, and section 4's ``ray job submit`` from the worker host, which only holds
the copied token. Every result equals Hugging Face greedy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from helpers.checkpoints import hf_greedy

from pagedserve.controller.tokenizer import load_tokenizer

PROMPTS = [[1, 17, 99, 4, 250, 31, 77], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 3]]
MAX_NEW = 10


def _write_prompts(path: Path) -> None:
    lines = [{"id": f"p{i}", "prompt_token_ids": p, "max_tokens": MAX_NEW, "temperature": 0.0,
              "ignore_eos": True} for i, p in enumerate(PROMPTS)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _records(path: Path) -> dict[str, list[int]]:
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert all("error" not in r for r in recs), recs
    return {r["id"]: r["token_ids"] for r in recs}


def _expected(hf_model) -> dict[str, list[int]]:
    return {f"p{i}": hf_greedy(hf_model, p, MAX_NEW) for i, p in enumerate(PROMPTS)}


def test_generate_on_the_head_as_readme(cluster, hf_model):
    _write_prompts(cluster.work / "prompts.jsonl")
    cluster.walk.run("generate", cluster.head, cluster.work, timeout=240)
    assert _records(cluster.work / "results.jsonl") == _expected(hf_model)


def test_job_submit_from_another_host_as_readme(cluster, hf_model):
    batch = cluster.work / "batch"
    batch.mkdir(exist_ok=True)
    _write_prompts(batch / "prompts.jsonl")
    proc = cluster.walk.run("submit", cluster.worker, cluster.work, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _records(cluster.work / "job.out.jsonl") == _expected(hf_model)


def test_job_submit_without_the_token_is_refused(cluster):
    # The same submitter without the mode: Ray refuses it, as the README warns.
    script = cluster.walk.script("submit").replace("export RAY_AUTH_MODE=token", "")
    proc = cluster.worker.run(["bash", "-c", script], cwd=cluster.work, check=False,
                              env={"RAY_AUTH_MODE": "disabled"}, timeout=120)
    assert proc.returncode != 0
    assert "authentication" in (proc.stdout + proc.stderr).lower()


def _wait_healthy(url: str, server: subprocess.Popen[str], log: Path, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the server exited: {log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    tail = log.read_text()[-3000:]
    raise AssertionError(f"the server was not healthy within {limit_s} s: {tail}")


def test_serve_on_the_head_answers_a_client_on_another_host(cluster, hf_model):
    log = cluster.work / "serve.log"
    server = cluster.walk.popen("serve", cluster.head, cluster.work, log)
    try:
        _wait_healthy(f"http://{cluster.head.ip}:8000/health", server, log, limit_s=180)
        reply = json.loads(cluster.walk.run("client", cluster.worker, cluster.work).stdout)
        assert "choices" in reply, reply
        choice = reply["choices"][0]
        tok = load_tokenizer(str(cluster.checkpoint))
        assert tok is not None
        prompt = cluster.walk.script("client").split('"prompt": "', 1)[1].split('"', 1)[0]
        want = hf_greedy(hf_model, tok.encode(prompt), 16)
        if choice["finish_reason"] == "stop":  # the server stops at EOS, transformers here not
            want = want[: want.index(2)] if 2 in want else want
        assert choice["text"] == tok.decode(want)
    finally:
        os.kill(server.pid, signal.SIGINT)  # pagedserve serve shuts its engine down on ^C
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)
