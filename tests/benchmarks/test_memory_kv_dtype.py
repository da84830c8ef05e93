"""``bench memory --kv-cache-dtype``: the same KV bytes hold element-bytes-times the slots, as
the engine's block count does (the experiments replaced by a recorder: no time)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import pagedserve.benchmarks.memory as memory
from pagedserve.cli import main
from pagedserve.config import ConfigError


def _options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *argv: str) -> Any:
    seen: list[Any] = []
    monkeypatch.setattr(memory, "run_memory", seen.append)
    assert main(["bench", "memory", "--no-progress", "--out", str(tmp_path), *argv]) == 0
    return seen[0]


@pytest.mark.parametrize(("model", "kv", "ratio"), [
    ("float32", "auto", 1), ("float32", "bfloat16", 2), ("float32", "fp8_e4m3", 4),
    ("float16", "bfloat16", 1), ("float16", "fp8_e4m3", 2),
])
def test_slots_follow_the_kv_dtype(monkeypatch, tmp_path, model: str, kv: str,
                                   ratio: int) -> None:
    o = _options(monkeypatch, tmp_path, "--model-dtype", model, "--kv-cache-dtype", kv,
                 "--kv-tokens", "4096")
    assert o.kv_slots() == ratio * 4096
    assert o.kv_token_bytes() * ratio == o.model_token_bytes()
    assert o.model_token_bytes() == 2 * 40 * 5120 * (4 if model == "float32" else 2)  # OPT-13B
    assert {c.kv_tokens for _, c in memory._plan(o)} == {ratio * 4096}  # every simulated run
    table = {r["kv_cache_dtype"]: r for r in memory._kv_dtype_table(o)}
    assert table[kv]["token_slots"] == ratio * 4096
    assert table[kv]["token_slots"] * table[kv]["bytes_per_token"] == table[kv]["budget_bytes"]


def test_unknown_kv_dtype_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        memory.run_memory(memory.MemoryOptions(out=tmp_path, kv_cache_dtype="fp4"))
    assert info.value.field == "kv_cache_dtype"
    assert not any(tmp_path.iterdir())  # refused before anything was written
