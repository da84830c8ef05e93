"""The command-line options of ``pagedserve generate`` and ``pagedserve serve`` (``cli.py``
registers them): ``engine_args`` (shared engine options), ``generate``, ``serve``."""
