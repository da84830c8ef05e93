"""Fixtures of the multi-host suite: test hosts in network namespaces, one real Ray cluster on
them started by deploy/README.md's own commands, and one driver process on the head.

Everything is session-scoped because a Ray node takes 10-20 s to start on a small machine: the
hosts, the cluster and the driver are made once and shared by every test here. The suite's tests
run one after another, the one that kills a worker node last (``pytest_collection_modifyitems``),
and the suite is torn down as soon as its last test is done, not at the end of the session: an
idle cluster's daemons would take CPU from every later test. The teardown stops the driver, kills
every process of every host by pid, deletes every namespace and link, and then fails if anything
of the suite is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers.checkpoints import make_checkpoint
from helpers.netns import ROOT, Host, TestNet, leftovers, skip_reason

import pagedserve

REPO = Path(pagedserve.__file__).resolve().parent
README = REPO / "deploy" / "README.md"
DRIVER = Path(__file__).resolve().parent / "driver.py"
TOKEN_ENV = {"RAY_AUTH_MODE": "token"}  # what README tells a shell on a node to export
LAST = ("test_node_failure.py",)
HERE = Path(__file__).resolve().parent
# The suite's clean-ups (the driver's stop, then the hosts'), closed once its last test is done
# (``pytest_runtest_teardown``) or, should the session stop earlier, by testnet's finalizer.
SUITE = contextlib.ExitStack()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # This hook sees the whole session. The suite's tests go one after another where its first
    # one was, and killing a node ends the shared cluster's second host: that test goes last.
    mine = [item for item in items if item.path.parent == HERE]
    if not mine:
        return
    at = items.index(mine[0])
    rest = [item for item in items if item.path.parent != HERE]
    mine.sort(key=lambda item: item.path.name in LAST)
    items[:] = rest[:at] + mine + rest[at:]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    result = yield
    if nextitem is None or nextitem.path.parent != HERE:
        SUITE.close()
    return result


def walkthrough_blocks(text: str) -> dict[str, str]:
    """README's bash blocks marked ``<!-- walkthrough: NAME -->``, by name."""
    pattern = re.compile(r"<!-- walkthrough: (\S+) -->\n```bash\n(.*?)```", re.S)
    return {m.group(1): m.group(2) for m in pattern.finditer(text)}


class Walkthrough:
    """deploy/README.md's commands, run as written on the test hosts.

    Only the values a reader replaces with their own change: the example addresses become the
    test hosts', the example model the tiny checkpoint, the example sizes what two hosts of two
    CPUs hold, and the example paths this run's directories."""

    def __init__(self, subs: Mapping[str, str]) -> None:
        self.blocks = walkthrough_blocks(README.read_text())
        self.subs = dict(subs)

    def script(self, name: str) -> str:
        text = self.blocks[name]
        for old, new in self.subs.items():
            text = text.replace(old, new)
        return text

    def run(self, name: str, host: Host, cwd: Path, timeout: float = 180.0,
            env: Mapping[str, str] | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        return host.run(["bash", "-euo", "pipefail", "-c", self.script(name)], cwd=cwd,
                        timeout=timeout, env=env, check=check)

    def popen(self, name: str, host: Host, cwd: Path, log: Path) -> subprocess.Popen[str]:
        out = open(log, "w")  # noqa: SIM115 (closed with the process by the caller)
        return host.popen(["bash", "-euo", "pipefail", "-c", self.script(name)], cwd=cwd,
                          stdout=out, stderr=subprocess.STDOUT)


@dataclass
class Cluster:
    net: TestNet
    head: Host
    worker: Host
    checkpoint: Path
    work: Path
    walk: Walkthrough


def _destroy(net: TestNet) -> None:
    net.destroy()
    left = leftovers()
    assert not left, f"the multi-host suite left these behind: {left}"


@pytest.fixture(scope="session")
def testnet(request: pytest.FixtureRequest) -> TestNet:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    request.addfinalizer(SUITE.close)
    net = TestNet.create(2)
    SUITE.callback(_destroy, net)
    return net


@pytest.fixture(scope="session")
def cluster(testnet: TestNet) -> Cluster:
    head, worker = testnet.hosts
    work = ROOT / "work"
    work.mkdir(parents=True, exist_ok=True)
    (work / "deploy").symlink_to(REPO / "deploy")  # README's commands run from the source tree
    ckpt = make_checkpoint("llama", work / "ckpt")
    walk = Walkthrough({
        "10.0.0.10": head.ip,
        "10.0.0.11": worker.ip,
        "/models/Qwen2.5-7B-Instruct": str(ckpt),
        "Qwen2.5-7B-Instruct": ckpt.name,  # the served model's name: its directory's
        "--tp 8": "--tp 2",
        "--tp 4": "--tp 2",
        "--gpus 16": "--gpus 0",
        "/shared/results.jsonl": str(work / "results.jsonl"),
        "/shared/results/prompts.out.jsonl": str(work / "job.out.jsonl"),
        "/path/to/pagedserve/deploy": str(REPO / "deploy"),
        "cd my-batch/": f"cd {work / 'batch'}/",
    })
    # Test-only: the head declares a lost node dead within ~2 s instead of ~15 s (Ray's
    # health-check defaults), so the node-failure test's restart does not wait that out.
    walk.run("head", head, work, env={"RAY_health_check_period_ms": "500",
                                      "RAY_health_check_failure_threshold": "3"})
    # README: copy the head's token file to every other node (scp there, a copy here).
    (worker.home / ".ray").mkdir(parents=True, exist_ok=True)
    shutil.copy(head.home / ".ray" / "auth_token", worker.home / ".ray" / "auth_token")
    walk.run("worker", worker, work)
    head.run([sys.executable, "deploy/scripts/wait_for_nodes.py", "--nodes", "2",
              "--timeout", "60"], cwd=work, env=TOKEN_ENV)
    return Cluster(testnet, head, worker, ckpt, work, walk)


class Driver:
    """The driver process on the head (tests/multihost/driver.py), one JSON line each way."""

    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc = proc
        self.log = log
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self._lines.put(line[2:])
        self._lines.put(None)

    def answer(self, timeout_s: float = 240.0) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            line = None
        if line is None:
            tail = self.log.read_text()[-4000:] if self.log.exists() else ""
            raise AssertionError(f"the driver gave no answer; its log ends with:\n{tail}")
        return json.loads(line)  # type: ignore[no-any-return]

    def __call__(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        answer = self.answer()
        assert "error" not in answer, answer.get("traceback") or answer["error"]
        return answer


def _stop_driver(proc: subprocess.Popen[str], err: Any) -> None:
    try:
        if proc.poll() is None and proc.stdin is not None:
            proc.stdin.write('{"op": "quit"}\n')
            proc.stdin.flush()
        proc.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, 9)
        proc.wait(timeout=10)
    err.close()


@pytest.fixture(scope="session")
def driver(cluster: Cluster) -> Driver:
    log = cluster.work / "driver.log"
    err = open(log, "w")  # noqa: SIM115 (closed by _stop_driver)
    proc = cluster.head.popen(
        [sys.executable, str(DRIVER), str(cluster.checkpoint)], cwd=cluster.work,
        env={**TOKEN_ENV, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
    )
    SUITE.callback(_stop_driver, proc, err)  # before the hosts go (the stack runs newest first)
    drv = Driver(proc, log)
    assert drv.answer(timeout_s=120).get("ready")
    return drv


@pytest.fixture(scope="session")
def hf_model(cluster: Cluster) -> Any:
    from helpers.checkpoints import load_hf_model

    return load_hf_model(cluster.checkpoint)
