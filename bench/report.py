"""Shared output helpers: the command line that made a result, JSON and markdown tables."""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

__all__ = ["command_line", "emit_table", "fmt_pct", "md_table", "write_json"]


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
