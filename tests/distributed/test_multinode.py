"""Tensor parallelism across (fake) nodes: a ``ray.cluster_utils.Cluster`` with a head and a
worker node on this machine, one CPU each, tp = 2 with SPREAD: one rank on the controller's
node (this process's, the head) and one on the other. Every fake node has the same IP, so this
also checks that placement and ranks are keyed by node id."""

from __future__ import annotations

import time

import pytest
import ray
from helpers.checkpoints import hf_greedy, load_hf_model, make_checkpoint
from helpers.driver import drive
from helpers.ray_group import ray_executor
from ray.cluster_utils import Cluster

from pagedserve.cluster.placement import rank_order
from pagedserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedserve.controller.engine_core import EngineCore
from pagedserve.messages import SamplingParams

PROMPTS = [[1, 17, 99, 4, 250, 31, 77], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 3]]
MAX_NEW = 16


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        nodes = [c.add_node(num_cpus=1)]
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()


def test_tp2_spread_over_two_nodes(cluster, tmp_path, request):
    path = make_checkpoint("llama", tmp_path / "ckpt")
    config = EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32"),
        cache=CacheConfig(block_size=4, kv_cache_memory_bytes=1 << 22),
        parallel=ParallelConfig(tensor_parallel_size=2, placement_strategy="SPREAD"),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
    )
    executor = ray_executor(config, ready_timeout_s=120, step_timeout_s=60)
    request.addfinalizer(executor.shutdown)
    engine = drive(EngineCore(config, executor, eos_token_ids=()))

    controller = ray.get_runtime_context().get_node_id()
    table = executor.rank_table
    nodes = [s.node_id for s in table]
    assert len(set(nodes)) == 2, "SPREAD: one rank per node"
    assert len({n["NodeManagerAddress"] for n in ray.nodes()}) == 1  # one IP for every node
    # The table follows the rule: the controller's node first, then by first bundle index.
    bundle_nodes = {s.bundle_index: s.node_id for s in table}
    assert table == rank_order(bundle_nodes, controller)
    assert nodes[0] == controller  # rank 0, the output rank, beside the controller
    # And each actor really runs on its rank's node.
    infos = ray.get([a.node_info.remote() for a in executor.worker_actors()], timeout=30)
    assert [i["node_id"] for i in infos] == nodes
    assert [i["rank"] for i in infos] == [0, 1]

    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    done: dict[str, list[int]] = {}
    deadline = time.monotonic() + 120
    while engine.has_unfinished():
        assert time.monotonic() < deadline
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.outputs[0].token_ids
    hf = load_hf_model(path)
    assert [done[f"r{i}"] for i in range(len(PROMPTS))] == [
        hf_greedy(hf, p, MAX_NEW) for p in PROMPTS
    ]
