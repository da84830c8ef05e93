"""JSON bodies rendered in pieces: ``render_json`` gives the bytes Starlette's ``JSONResponse``
would, without one long C call.

``json.dumps`` holds the GIL from start to end: 0.4 s for the 13 MB of a 524,288-entry logprobs
answer, and the event loop waits all that time even when the call runs in another thread.
Long lists are rendered a slice at a time instead, so the GIL changes hands between slices.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["render_json"]

# Items of a list rendered per call: about 10 KB of logprobs JSON, well under a millisecond.
_SLICE = 256

_ENCODERS = {
    allow_nan: json.JSONEncoder(
        ensure_ascii=False, allow_nan=allow_nan, indent=None, separators=(",", ":")
    ).encode
    for allow_nan in (False, True)
}


def render_json(obj: Any, *, allow_nan: bool = False) -> bytes:
    """``obj`` as compact UTF-8 JSON, identical to ``json.dumps`` of it (with NaN refused
    unless ``allow_nan``, as ``JSONResponse`` refuses it)."""
    parts: list[str] = []
    _emit(obj, parts, _ENCODERS[allow_nan])
    return "".join(parts).encode("utf-8")


def _emit(obj: Any, out: list[str], dumps: Callable[[Any], str]) -> None:
    if isinstance(obj, list) and len(obj) > _SLICE:
        out.append("[")
        for i in range(0, len(obj), _SLICE):
            if i:
                out.append(",")
            chunk = obj[i : i + _SLICE]
            if any(isinstance(v, (list, dict)) for v in chunk):
                for j, v in enumerate(chunk):
                    if j:
                        out.append(",")
                    _emit(v, out, dumps)
            else:
                out.append(dumps(chunk)[1:-1])
        out.append("]")
    elif isinstance(obj, dict) and all(isinstance(k, str) for k in obj) and any(
        isinstance(v, (list, dict)) for v in obj.values()
    ):
        out.append("{")
        for i, (k, v) in enumerate(obj.items()):
            out.append(("," if i else "") + dumps(k) + ":")
            _emit(v, out, dumps)
        out.append("}")
    else:
        out.append(dumps(obj))
