"""Fixtures of the Ray tests: one local Ray instance for the whole directory.

A local Ray start-up costs seconds on a small machine (tens of seconds on a loaded one), so the
modules here share one instance (4 logical CPUs: each rank's bundle needs one) instead of
starting their own: ``ray_local`` connects (started by the first module that asks), and the
instance is shut down once the directory's last test is done. Every test leaves nothing of its
own running (its executors and engines are shut down in finalizers), which the release checks
of test_controller_errors.py hold the earlier modules to. test_multinode.py needs a cluster of
its own in this process: it runs after every other test here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
OWN_CLUSTER = "test_multinode.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # This hook sees the whole session: move the multi-node module behind the last test of this
    # directory, leaving every other item where it was.
    mine = [i for i, item in enumerate(items) if item.path.parent == HERE]
    if not mine:
        return
    last = mine[-1]
    own = [item for item in items[: last + 1] if item.path.name == OWN_CLUSTER
           and item.path.parent == HERE]
    if not own:
        return
    rest = [item for item in items[: last + 1] if item not in own]
    items[: last + 1] = rest + own


@pytest.fixture(scope="module")
def ray_local() -> None:
    """This process connected to the directory's shared local Ray instance."""
    from pagedserve.cluster.launch import ensure_ray

    ensure_ray(None, num_cpus=4, log_to_driver=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    result = yield  # the fixtures' finalizers (engines, executors) have run
    if nextitem is None or nextitem.path.parent != HERE:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    return result
