"""Tensor, data and decode-context parallelism across real test hosts, each equal to Hugging
Face greedy, and where the ranks land (by IP) under each placement strategy.

The hosts are network namespaces with one address each, and the host name resolves to
loopback on every one of them: a rank that advertised the host name's address to its peers
would fail gloo's full-mesh connect, so these runs pass only if every rank binds its
collectives to its own node IP.
"""

from __future__ import annotations

from collections import Counter

from helpers.checkpoints import hf_greedy, load_hf_model, make_checkpoint

PROMPTS = [[1, 17, 99, 4, 250, 31, 77], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 3]]
MAX_NEW = 12


def _ips(ranks: list[dict]) -> list[str]:
    return [r["node_ip"] for r in sorted(ranks, key=lambda r: r["rank"])]


def test_tp2_across_two_hosts_equals_hf(driver, cluster, hf_model):
    out = driver("generate", options={"tensor_parallel_size": 2, "placement_strategy": "SPREAD"},
                 prompts=PROMPTS, max_tokens=MAX_NEW)
    assert out["tokens"] == [hf_greedy(hf_model, p, MAX_NEW) for p in PROMPTS]
    (replica,) = out["replicas"]
    # The controller and rank 0 (the output rank) sit on the driver's node; rank 1 on the
    # other host.
    assert replica["controller_ip"] == cluster.head.ip
    assert _ips(replica["ranks"]) == [cluster.head.ip, cluster.worker.ip]


def test_tp2_dp2_four_ranks_on_two_hosts_equals_hf(driver, cluster, hf_model):
    out = driver("generate", options={"tensor_parallel_size": 2, "data_parallel_size": 2},
                 prompts=PROMPTS * 2, max_tokens=MAX_NEW)
    assert out["tokens"] == [hf_greedy(hf_model, p, MAX_NEW) for p in PROMPTS * 2]
    replicas = out["replicas"]
    assert len(replicas) == 2
    # PACK keeps each replica's TP group on one host; the two replicas fill both hosts.
    hosts = [set(_ips(r["ranks"])) for r in replicas]
    assert all(len(h) == 1 for h in hosts), hosts
    assert set.union(*hosts) == {cluster.head.ip, cluster.worker.ip}


def test_dcp2_across_two_hosts_equals_hf(driver, cluster):
    # One KV head, replicated by tp = 2: with dcp = 2 each rank keeps half of every sequence's
    # KV instead, and the ranks merge their partial attention across the hosts.
    path = make_checkpoint("llama", cluster.work / "ckpt-kv1", num_key_value_heads=1)
    hf_model = load_hf_model(path)
    out = driver("generate", options={"model": str(path), "tensor_parallel_size": 2,
                                      "decode_context_parallel_size": 2,
                                      "placement_strategy": "SPREAD"},
                 prompts=PROMPTS, max_tokens=MAX_NEW)
    assert out["tokens"] == [hf_greedy(hf_model, p, MAX_NEW) for p in PROMPTS]
    (replica,) = out["replicas"]
    assert _ips(replica["ranks"]) == [cluster.head.ip, cluster.worker.ip]


def test_placement_strategies_by_ip(driver, cluster):
    head, worker = cluster.head.ip, cluster.worker.ip
    # PACK: two ranks fit one host (2 CPUs each), so they share one.
    pack = driver("placement", strategy="PACK", world_size=2)["ranks"]
    assert len(set(_ips(pack))) == 1
    # PACK with more ranks than one host holds spills over, the driver's host first, and the
    # ranks of each host stay consecutive.
    spill = driver("placement", strategy="PACK", world_size=4)["ranks"]
    assert _ips(spill) == [head, head, worker, worker]
    spread = driver("placement", strategy="SPREAD", world_size=2)["ranks"]
    assert _ips(spread) == [head, worker]
    strict = driver("placement", strategy="STRICT_PACK", world_size=2)["ranks"]
    assert len(set(_ips(strict))) == 1
    assert Counter(_ips(spread)) == Counter({head: 1, worker: 1})
