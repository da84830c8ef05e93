"""``python benchmarks/bench_memory.py ARGS`` is ``pagedserve bench memory ARGS``."""

from __future__ import annotations

import sys

from pagedserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "memory", *sys.argv[1:]]))
