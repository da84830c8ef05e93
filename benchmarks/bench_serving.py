"""``python benchmarks/bench_serving.py ARGS`` is ``pagedserve bench serving ARGS``."""

from __future__ import annotations

import sys

from pagedserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serving", *sys.argv[1:]]))
