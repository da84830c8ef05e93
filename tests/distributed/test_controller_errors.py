"""A checkpoint that cannot be served fails ``LLM(...)`` on the Ray path with the loader's own
typed error, not a bare actor death, and leaves nothing running."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray

from pagedserve import LLM
from pagedserve.workers.errors import ModelLoadError, UnsupportedModelError


def _assert_released() -> None:
    """Every CPU is free again: the worker actors and their placement group are gone."""
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)


def test_missing_checkpoint(ray_local, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"), backend="ray")
    _assert_released()


def test_unsupported_architecture_lists_the_supported_ones(ray_local, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM") as info:
        LLM(str(tmp_path), backend="ray")
    assert "GPT2LMHeadModel" in str(info.value)
    _assert_released()
