"""Shared output helpers: where a run's files go, the command line that made a result, JSON and
markdown tables."""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

__all__ = [
    "RUNS_DIR", "command_line", "emit_table", "fmt_pct", "md_table", "results_dir", "write_json",
]

# Runs without an explicit destination land here, under the current directory, never in the
# committed docs/results/ (a --quick run from the repository root once replaced them).
RUNS_DIR = Path("bench-runs")


def results_dir(out: Path | str | None, name: str) -> Path:
    """The folder a run writes into: ``out`` when given (made if missing), else a fresh
    ``bench-runs/NAME-YYYYmmdd-HHMMSS`` under the current directory, announced on stdout.
    Regenerating the committed results takes an explicit ``--out docs/results/...``."""
    if out is not None:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        return path
    stamp = time.strftime("%Y%m%d-%H%M%S")
    RUNS_DIR.mkdir(exist_ok=True)
    for i in range(1, 1000):
        path = RUNS_DIR / (f"{name}-{stamp}" if i == 1 else f"{name}-{stamp}-{i}")
        try:
            path.mkdir()
        except FileExistsError:  # two runs in the same second
            continue
        print(f"no --out given: writing into {path}")
        return path
    raise FileExistsError(f"no fresh folder for {name} under {RUNS_DIR}")


def command_line(argv: list[str] | None) -> str:
    """``pagedserve bench ...`` as it was typed (``argv`` without the program name)."""
    args = sys.argv[1:] if argv is None else argv
    return "pagedserve " + " ".join(shlex.quote(a) for a in args)


def _clean(x: Any) -> Any:
    if isinstance(x, float):
        return None if not math.isfinite(x) else x
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return _clean(x.item())
    return x


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Strict JSON (NaN and infinities become null)."""
    path.write_text(json.dumps(_clean(doc), indent=1, allow_nan=False) + "\n")


def fmt_pct(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{100 * x:.{digits}f}%"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def emit_table(table: str, out: str | None) -> None:
    """Print a benchmark's markdown table and, with ``out``, append it to that file."""
    print(table)
    if out:
        with open(out, "a") as f:
            f.write(table + "\n")
