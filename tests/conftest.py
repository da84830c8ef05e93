"""Shared test fixtures. Lives in tests/, never at the repository root (the root is the package)."""

from __future__ import annotations

import os

import pytest

# Triton kernels run on CPU through the interpreter; set before triton is imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines in tests run in-process unless a test asks for Ray explicitly: one Ray start-up per
# engine would cost more than the whole test.
os.environ.setdefault("PAGEDSERVE_BACKEND", "local")


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
