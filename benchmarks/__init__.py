"""Experiments: ``pagedserve bench memory`` and ``pagedserve bench serving``.

* ``memory`` drives the real scheduler and KV manager with a no-compute executor and compares
  allocation policies under one KV budget (``memory_sim``, ``memory``, ``contiguous``);
* ``serving`` measures a running ``pagedserve serve`` (or ones it starts) over HTTP, with
  streaming clients timed per server-sent event (``serving``, ``prom``);
* ``workloads`` holds the synthetic length distributions and arrival processes, ``plots``
  the figures, ``report`` where a run's files go (``results_dir``: ``--out``, else a fresh
  folder, never the committed ``docs/results/``) and the tables. Nothing here imports torch,
  the kernels or the workers.

This package is the installed half of the measurements. The runnable scripts beside it in
``scripts/`` (kernels, engine, peers, chaos; not installed, some import torch) are not modules of
the package: ``python benchmarks/scripts/NAME.py``. They share ``report`` and ``prom`` from here.
"""
