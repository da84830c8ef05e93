"""A worker node killed mid-request, on three hosts: a third host joins the shared cluster (as
README's worker block says), a tp = 2 group spreads over two of them, and every process of a
worker host holding a rank is killed by pid while the group is generating.

The engine rebuilds its worker group on the capacity that is left (two live hosts) and the
requests in flight resume on it: they complete, with no error, with the text of an uninterrupted
run (equal to Hugging Face), and the engine serves again. Runs last (conftest): the cluster has
lost a host afterwards.
"""

from __future__ import annotations

import shutil
import sys

from helpers.checkpoints import hf_greedy

PROMPTS = [[1, 17, 99, 4, 250, 31, 77], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 3]]
LONG = 400  # tokens: the requests are still running when the node goes
MAX_NEW = 8


def _join_third_host(cluster):
    third = cluster.net.add_host()
    (third.home / ".ray").mkdir(parents=True)
    shutil.copy(cluster.head.home / ".ray" / "auth_token", third.home / ".ray" / "auth_token")
    script = cluster.walk.script("worker").replace(cluster.worker.ip, third.ip)
    third.run(["bash", "-euo", "pipefail", "-c", script], cwd=cluster.work)
    cluster.head.run([sys.executable, "deploy/scripts/wait_for_nodes.py", "--nodes", "3",
                      "--timeout", "60"], cwd=cluster.work, env={"RAY_AUTH_MODE": "token"})
    return third


def test_worker_node_killed_mid_request(driver, cluster, hf_model):
    head = cluster.head
    third = _join_third_host(cluster)
    hosts = {h.ip: h for h in (head, cluster.worker, third)}
    started = driver("start_long", options={"tensor_parallel_size": 2,
                                            "placement_strategy": "SPREAD"},
                     prompts=PROMPTS, max_tokens=LONG)
    (replica,) = started["replicas"]
    ranks = replica["ranks"]
    ips = [r["node_ip"] for r in ranks]
    assert len(set(ips)) == 2, replica  # SPREAD: two of the three hosts
    assert replica["controller_ip"] == head.ip  # beside the driver: it outlives other hosts
    # The victim: the host of the highest rank that is not the head's.
    lost = max((r for r in ranks if r["node_ip"] != head.ip), key=lambda r: r["rank"])
    victim = hosts[lost["node_ip"]]
    assert not started["finished_early"], "the requests ended before the node was killed"

    victim.kill_all()
    assert victim.pids() == []

    out = driver("finish_long", prompts=PROMPTS, max_tokens=MAX_NEW)
    errors = out["errors"]
    assert len(errors) == len(PROMPTS) and all(e is None for e in errors.values()), errors
    assert [out["tokens"][f"long-{i}"] for i in range(len(PROMPTS))] == [
        hf_greedy(hf_model, p, LONG) for p in PROMPTS
    ]
    assert "again_error" not in out, out
    assert out["again"] == [hf_greedy(hf_model, p, MAX_NEW) for p in PROMPTS]
    (after,) = out["replicas"]
    live = set(hosts) - {victim.ip}
    assert {r["node_ip"] for r in after["ranks"]} <= live, after
