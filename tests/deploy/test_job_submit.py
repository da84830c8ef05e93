"""The batch job as a Ray job on a real (single-node) Ray head, started here.

The entrypoint is the command deploy/README.md tells users to submit, ``pagedserve generate
--address auto --input ... --output ...``, with deploy/jobs/runtime_env.yaml and a working dir
that holds only the input file (pagedserve comes from the installed package, never from the
working dir: the source root would shadow real packages on sys.path).

How the job is submitted depends on the Ray install:
- with ``ray[default]`` (dashboard + job server available): ``ray job submit --working-dir ...
  --runtime-env ... -- <entrypoint>`` against the head's job server, the exact user path;
- with minimal Ray (no dashboard): Ray's job manager driven in this process against the same
  head -- the same supervisor actor, runtime-env upload and entrypoint subprocess that the job
  server would use, minus the HTTP layer.

The head is a ``ray start --head --block`` process in its own session with its own temp dir and
ports; the finalizer kills that process group (and anything else still running from its temp
dir), never other Ray instances on the machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.checkpoints import make_checkpoint

import pagedserve

DEPLOY = Path(pagedserve.__file__).resolve().parent / "deploy"
RAY = str(Path(sys.executable).parent / "ray")
JOB_TIMEOUT_S = 60.0
ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dashboard_available() -> bool:
    import ray._private.utils as ray_utils

    return ray_utils.get_dashboard_dependency_error() is None


def _kill_leftovers(marker: str) -> None:
    """SIGKILL any process whose command line names this head's private temp dir."""
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    for pid in (int(p) for p in out.split()):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def ray_head() -> Iterator[dict[str, Any]]:
    temp_dir = tempfile.mkdtemp(prefix="psray-", dir="/tmp")  # short: unix socket paths
    port, dash_port = _free_port(), _free_port()
    with_dashboard = _dashboard_available()
    cmd = [
        RAY, "start", "--head", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
        f"--temp-dir={temp_dir}", "--disable-usage-stats", "--block",
        f"--include-dashboard={'true' if with_dashboard else 'false'}",
        f"--dashboard-port={dash_port}", f"--dashboard-agent-listen-port={_free_port()}",
        "--dashboard-host=127.0.0.1",
    ]
    env = {**os.environ, **ENV}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        address, log = None, []
        assert head.stdout is not None
        deadline = time.monotonic() + 60
        for line in head.stdout:  # `ray start` prints the address, then blocks
            log.append(line)
            m = re.search(r"ray start --address='([^']+)'", line)
            address = m.group(1) if m else address
            if address and "--block" in line:
                break
            if time.monotonic() > deadline:
                break
        if address is None:
            pytest.fail("the Ray head did not start within 60 s:\n" + "".join(log[-30:]))
        yield {"address": address, "dashboard": f"http://127.0.0.1:{dash_port}" if
               with_dashboard else None, "temp_dir": temp_dir, "env": env}
    finally:
        try:
            os.killpg(head.pid, signal.SIGTERM)
            head.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(head.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _kill_leftovers(temp_dir)
        head.wait(timeout=10)


def _entrypoint(ckpt: Path, output: Path) -> list[str]:
    return [
        "pagedserve", "generate", "--address", "auto", "--model", str(ckpt),
        "--max-model-len", "64", "--num-gpu-blocks", "64", "--max-tokens", "4", "--ignore-eos",
        "--input", "in.jsonl", "--output", str(output), "--progress", "log",
    ]


def _runtime_env(tmp: Path, working_dir: Path) -> dict[str, Any]:
    env = yaml.safe_load((DEPLOY / "jobs" / "runtime_env.yaml").read_text(encoding="utf-8"))
    env["env_vars"] = {**env.get("env_vars", {}), "HF_HOME": str(tmp / "hf-cache"), **ENV}
    env["working_dir"] = str(working_dir)
    return env


def _submit_with_cli(head: dict[str, Any], entrypoint: list[str], runtime_env: dict[str, Any],
                     tmp: Path) -> tuple[str, str]:
    from ray.job_submission import JobSubmissionClient

    env_file = tmp / "runtime_env.yaml"
    working_dir = runtime_env.pop("working_dir")
    env_file.write_text(yaml.safe_dump(runtime_env), encoding="utf-8")
    job_id = f"pagedserve-test-{os.getpid()}"
    subprocess.run(
        [RAY, "job", "submit", "--address", head["dashboard"], "--submission-id", job_id,
         "--working-dir", working_dir, "--runtime-env", str(env_file), "--no-wait", "--",
         *entrypoint],
        check=True, env=head["env"], timeout=60,
    )
    client = JobSubmissionClient(head["dashboard"])
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not client.get_job_status(job_id).is_terminal():
        if time.monotonic() > deadline:
            client.stop_job(job_id)
            break
        time.sleep(0.5)
    return str(client.get_job_status(job_id)), client.get_job_logs(job_id)


def _submit_in_process(head: dict[str, Any], entrypoint: list[str],
                       runtime_env: dict[str, Any]) -> tuple[str, str]:
    import ray
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed
    from ray.dashboard.modules.job.job_manager import JobManager

    ray.init(address=head["address"], logging_level="ERROR", log_to_driver=False)
    try:
        # What the job server does with an uploaded --working-dir: a gcs:// package URI.
        env = upload_working_dir_if_needed(runtime_env, include_gitignore=True)
        gcs = ray._private.worker.global_worker.gcs_client

        async def run() -> tuple[str, str]:
            manager = JobManager(gcs, os.path.join(head["temp_dir"], "job-logs"))
            job_id = await manager.submit_job(entrypoint=shlex.join(entrypoint), runtime_env=env)
            deadline = time.monotonic() + JOB_TIMEOUT_S
            while not (status := await manager.get_job_status(job_id)).is_terminal():
                if time.monotonic() > deadline:
                    await manager.stop_job(job_id)
                    break
                await asyncio.sleep(0.25)
            return str(status), manager.get_job_logs(job_id)

        return asyncio.run(run())
    finally:
        ray.shutdown()


def test_wait_for_nodes_script(ray_head: dict[str, Any]) -> None:
    script = str(DEPLOY / "scripts" / "wait_for_nodes.py")
    base = [sys.executable, script, "--address", ray_head["address"]]
    ok = subprocess.run([*base, "--nodes", "1", "--timeout", "20"], env=ray_head["env"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "1/1 nodes alive" in ok.stdout
    late = subprocess.run([*base, "--nodes", "2", "--timeout", "1"], env=ray_head["env"],
                          capture_output=True, text=True, timeout=60)
    assert late.returncode == 1 and "timed out" in late.stderr


def test_generate_runs_as_a_ray_job(ray_head: dict[str, Any], tmp_path: Path) -> None:
    from pagedserve.cli import build_parser

    ckpt = make_checkpoint("llama", tmp_path / "ckpt")
    output = tmp_path / "results" / "out.jsonl"
    output.parent.mkdir()
    entrypoint = _entrypoint(ckpt, output)
    try:
        build_parser().parse_args(entrypoint[1:])
    except SystemExit:
        pytest.fail(f"`{shlex.join(entrypoint)}` does not parse with pagedserve.cli: is "
                    "`generate` wired to serving.generate_cli.add_generate_arguments?")

    working_dir = tmp_path / "job"
    working_dir.mkdir()
    lines = [{"id": "a", "prompt": "Hello"}, {"id": "b", "prompt_token_ids": [3, 4, 5]},
             {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}]
    (working_dir / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    runtime_env = _runtime_env(tmp_path, working_dir)

    if ray_head["dashboard"] is not None:
        status, logs = _submit_with_cli(ray_head, entrypoint, runtime_env, tmp_path)
    else:
        status, logs = _submit_in_process(ray_head, entrypoint, runtime_env)
    assert status.endswith("SUCCEEDED"), f"job {status}; its logs:\n{logs[-4000:]}"
    assert "3 succeeded, 0 failed" in logs, logs[-4000:]

    records = [json.loads(t) for t in output.read_text().splitlines()]
    assert sorted(str(r["id"]) for r in records) == ["3", "a", "b"]
    by_id = {r["id"]: r for r in records}
    assert all("error" not in r for r in records)
    assert [len(by_id[k]["token_ids"]) for k in ("a", "b", 3)] == [4, 4, 2]
    assert by_id["a"]["prompt"] == "Hello" and by_id["b"]["usage"]["prompt_tokens"] == 3
