"""A Ray executor for tests, with the placement group a launcher would own."""

from __future__ import annotations

from typing import Any

from pagedserve.builder import make_executor
from pagedserve.cluster.placement import remove_quietly, reserve_worker_group


def ray_executor(config: Any, *, bundle: dict[str, float] | None = None,
                 placement_timeout_s: float = 30.0, **options: Any) -> Any:
    """Reserve the worker group's placement group, build the executor in it; the executor's
    ``shutdown`` also frees the group (here the test is the owner)."""
    par = config.parallel
    pg = reserve_worker_group(par.world_size, par.placement_strategy, placement_timeout_s, bundle)
    ex = make_executor(config, "ray", pg, placement_timeout_s=placement_timeout_s, **options)
    stop = ex.shutdown

    def shutdown() -> None:
        stop()
        remove_quietly(pg)

    ex.shutdown = shutdown
    return ex
