"""Experiments: ``pagedserve bench memory`` and ``pagedserve bench serving``.

* ``memory`` drives the real scheduler and KV manager with a no-compute executor and compares
  allocation policies under one KV budget (``memory_sim``, ``memory``, ``contiguous``);
* ``serving`` measures a running ``pagedserve serve`` (or ones it starts) over HTTP, with
  streaming clients timed per server-sent event (``serving``, ``prom``);
* ``workloads`` holds the synthetic length distributions and arrival processes, ``plots``
  the figures. Nothing here imports torch, the kernels or the workers.
"""
