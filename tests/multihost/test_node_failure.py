"""A worker node killed mid-request: every process of the worker host, by pid, while a tp = 2
group with one rank on each host is generating.

The requests in flight fail with a typed error that names the lost node; the engine rebuilds
its worker group on the capacity that is left (the head holds both ranks now) and serves again,
equal to Hugging Face. Runs last (conftest): the shared cluster has one host less afterwards.
"""

from __future__ import annotations

from helpers.checkpoints import hf_greedy

PROMPTS = [[1, 17, 99, 4, 250, 31, 77], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 3]]
LONG = 400  # tokens: the requests are still running when the node goes
MAX_NEW = 8


def test_worker_node_killed_mid_request(driver, cluster, hf_model):
    head, worker = cluster.head, cluster.worker
    started = driver("start_long", options={"tensor_parallel_size": 2,
                                            "placement_strategy": "SPREAD"},
                     prompts=PROMPTS, max_tokens=LONG)
    (replica,) = started["replicas"]
    ranks = replica["ranks"]
    assert [r["node_ip"] for r in ranks] == [head.ip, worker.ip]
    assert replica["controller_ip"] == head.ip  # beside the driver: the engine outlives h2
    assert not started["finished_early"], "the requests ended before the node was killed"
    lost_node = ranks[1]["node_id"]

    worker.kill_all()
    assert worker.pids() == []

    out = driver("finish_long", prompts=PROMPTS, max_tokens=MAX_NEW)
    errors = out["errors"]
    assert len(errors) == len(PROMPTS) and all(e is not None for e in errors.values()), errors
    for error in errors.values():
        assert lost_node in error and worker.ip in error, error
    assert "again_error" not in out, out.get("again_error")
    assert out["again"] == [hf_greedy(hf_model, p, MAX_NEW) for p in PROMPTS]
    (after,) = out["replicas"]
    assert [r["node_ip"] for r in after["ranks"]] == [head.ip, head.ip]
