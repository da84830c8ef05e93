"""Fixtures for worker tests: the checkpoint helpers and the stepper (``checkpoint_dir`` is
the suite's, ``tests/conftest.py``).

``tests/`` is on pytest's ``pythonpath`` (pyproject), so the shared helpers import as
``helpers.*``.
"""

from __future__ import annotations

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
