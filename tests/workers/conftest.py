"""Fixtures for worker tests: tiny checkpoints (written once per session) and the stepper.

``tests/`` is on pytest's ``pythonpath`` (pyproject), so the shared helpers import as
``helpers.*``.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from helpers import checkpoints as _checkpoints
from helpers import stepper as _stepper


@pytest.fixture(scope="session")
def checkpoints() -> ModuleType:
    return _checkpoints


@pytest.fixture(scope="session")
def stepper_module() -> ModuleType:
    return _stepper


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """``checkpoint_dir(kind)``: a tiny checkpoint of that kind, written once per session."""
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = _checkpoints.make_checkpoint(kind, tmp_path_factory.mktemp(kind))
        return made[kind]

    return get
