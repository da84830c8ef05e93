"""Shared test fixtures. Lives in tests/, never at the repository root (the root is the package)."""

from __future__ import annotations

import os

# Triton kernels run on CPU through the interpreter; set before triton is imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines in tests run in-process unless a test asks for Ray explicitly: one Ray start-up per
# engine would cost more than the whole test.
os.environ.setdefault("PAGEDSERVE_BACKEND", "local")
