"""Two data-parallel replicas behind the prefix-aware router, on the Ray path."""

from __future__ import annotations

import random

import pytest
from helpers.checkpoints import hf_greedy, load_hf_model, make_checkpoint

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.router import Router

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    return make_checkpoint("qwen2", tmp_path_factory.mktemp("ckpt") / "qwen2")


@pytest.fixture(scope="module")
def llm(ckpt, ray_local):
    engine = None
    try:
        engine = LLM(str(ckpt), backend="ray", data_parallel_size=2, block_size=16,
                     max_model_len=128, num_gpu_blocks=64)
        yield engine
    finally:
        if engine is not None:
            engine.shutdown()


def test_shared_prefixes_land_on_one_replica_and_all_complete(llm, ckpt) -> None:
    router = llm.client
    assert isinstance(router, Router) and len(router.replicas) == 2
    rng = random.Random(3)
    prefixes = [[rng.randrange(3, 512) for _ in range(40)] for _ in range(4)]
    first = [p + [rng.randrange(3, 512)] for p in prefixes]
    second = [p + [rng.randrange(3, 512) for _ in range(1 + i % 3)]
              for i, p in enumerate(prefixes * 2)]
    outs = llm.generate(first, GREEDY, use_tqdm=False)
    outs += llm.generate(second, GREEDY, use_tqdm=False)

    hf = load_hf_model(ckpt)
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(hf, p, MAX_NEW) for p in first + second
    ]
    # Every request of a prefix went to the replica of that prefix's first request...
    routes = {rid: replica for rid, replica, _ in router.routes}
    ids = [o.request_id for o in outs]
    for k in range(len(prefixes)):
        group = [ids[k], ids[len(first) + k], ids[len(first) + len(prefixes) + k]]
        assert len({routes[r] for r in group}) == 1, (k, [routes[r] for r in group])
    assert {reason for _, _, reason in router.routes} <= {"new-prefix", "prefix"}
    # ...so the later ones hit its prefix cache (two full blocks of 16 at least).
    assert all(o.num_cached_tokens >= 32 for o in outs[len(first):])
    stats = router.stats()
    per = stats["replicas"]
    assert len(per) == 2 and all(r["healthy"] for r in per)
    assert stats["prefix_cache_hits"] >= 32 * len(second)
    assert sum(r["in_flight"] for r in per) == 0
