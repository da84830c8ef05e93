"""Shared test fixtures. Lives in tests/, never at the repository root (the root is the package)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Triton kernels run on CPU through the interpreter; set before triton is imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines in tests run in-process unless a test asks for Ray explicitly: one Ray start-up per
# engine would cost more than the whole test.
os.environ.setdefault("PAGEDSERVE_BACKEND", "local")


# Tests that share something expensive made once per process run in one pytest-xdist worker,
# one after another: the multi-host cluster and its namespaces, the directory's local Ray
# instance, and the default model converted once (``real_model_cache``). Keyed by node-id
# prefix (relative to the repository root); every other test is a unit of its own.
XDIST_GROUPS = {
    "tests/multihost/": "multihost",
    "tests/distributed/": "ray-local",
    "tests/test_readme.py::": "real-model",
    "tests/test_real_model.py::": "real-model",
    "tests/benchmarks/test_schema_conformance.py::": "real-model",
}


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with the groups above as scopes: a scope goes to one
        worker whole, the largest first."""

        def _split_scope(self, nodeid: str) -> str:
            for prefix, group in XDIST_GROUPS.items():
                if nodeid.startswith(prefix):
                    return group
            return nodeid

    return GroupScheduling(config, log)


@pytest.fixture(scope="session")
def real_model_cache(tmp_path_factory: pytest.TempPathFactory):
    """An ``XDG_CACHE_HOME`` holding the default model (SmolLM2-135M-Instruct) converted once
    for the whole session; skips when its packages are not installed."""
    from helpers.real_model import convert_into, skip_reason

    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    cache = tmp_path_factory.mktemp("xdg-cache")
    convert_into(cache)
    return cache


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory):
    """``checkpoint_dir(kind)``: a tiny checkpoint of that kind, written once per session."""
    from helpers.checkpoints import make_checkpoint

    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_checkpoint(kind, tmp_path_factory.mktemp(kind))
        return made[kind]

    return get
