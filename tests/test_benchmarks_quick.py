"""The benchmarks' quick modes run to the end and print their tables, in a fresh process each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_controller_step_quick(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "controller_step.md"
    cmd = [sys.executable, str(BENCHMARKS / "controller_step.py"), "--quick", "--label", "quick",
           "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| output length | median µs per step | vs 16 tokens |" in proc.stdout
    assert "| 16 |" in proc.stdout and "| 32 |" in proc.stdout
    assert "## quick" in out.read_text() and "| 16 |" in out.read_text()
