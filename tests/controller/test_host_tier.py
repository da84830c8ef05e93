"""The host tier end to end through the engine core and the fake worker.

The fake worker keeps a host pool beside its device pool, runs the step's tier copies in the
workers' order (device -> host, then host -> device, then copy-on-write) and checks that every
KV position a request attends to holds that request's token. So a swap-in that restores the
wrong block, or a prefix hit served from a host block with other contents, fails here.
"""

from __future__ import annotations

import pytest

from pagedserve.config import ConfigError, from_flat
from pagedserve.controller.executor import WorkerGroupError
from pagedserve.messages import SamplingParams


def prompt(start: int, n: int) -> list[int]:
    return [(start + i) % 997 + 1 for i in range(n)]


def _workload(eng, n_req: int = 6, max_tokens: int = 14, n: int = 1) -> None:
    for i in range(n_req):
        params = SamplingParams(max_tokens=max_tokens, n=n, seed=i if n > 1 else None)
        eng.add_request(f"r{i}", prompt(37 * i, 6 + i), params)


def _tokens(outs) -> dict[str, list[list[int]]]:
    return {k: [c.token_ids for c in v.outputs] for k, v in outs.items()}


@pytest.mark.parametrize("caching", [True, False])
def test_swap_preemption_gives_identical_outputs(kit, caching: bool) -> None:
    ref = kit.make_engine(num_gpu_blocks=256, enable_prefix_caching=caching)
    _workload(ref)
    expected = kit.run(ref)
    eng = kit.make_engine(num_gpu_blocks=14, max_num_batched_tokens=32, num_host_blocks=64,
                          preemption_mode="swap", enable_prefix_caching=caching)
    _workload(eng)
    got = kit.run(eng)
    stats = eng.stats()
    assert stats["num_preemptions"] > 0
    assert stats["kv_host_swap_outs"] == stats["num_preemptions"] == stats["kv_host_swap_ins"]
    assert stats["kv_host_swap_fallbacks"] == 0
    # Resumed where they stopped: re-added with their computed tokens, not from 0.
    resumed = [nr for so in eng.executor.outputs for nr in so.new_reqs if nr.output_token_ids]
    assert resumed and all(nr.num_computed_tokens == len(nr.prompt_token_ids)
                           + len(nr.output_token_ids) - 1 for nr in resumed)
    assert any(so.blocks_to_device for so in eng.executor.outputs)
    assert _tokens(got) == _tokens(expected)
    kit.assert_idle(eng)


def test_swap_falls_back_to_recompute_when_the_host_tier_is_full(kit) -> None:
    ref = kit.make_engine(num_gpu_blocks=256)
    _workload(ref)
    eng = kit.make_engine(num_gpu_blocks=14, max_num_batched_tokens=32, num_host_blocks=4,
                          preemption_mode="swap")
    _workload(eng)
    got = kit.run(eng)
    stats = eng.stats()
    assert stats["kv_host_swap_fallbacks"] > 0
    assert stats["num_preemptions"] == stats["kv_host_swap_outs"] + stats["kv_host_swap_fallbacks"]
    assert _tokens(got) == _tokens(kit.run(ref))
    kit.assert_idle(eng)


def test_swap_with_sliding_window_groups_and_forks(kit) -> None:
    def engine(**kw):
        return kit.make_engine(executor=kit.FakeExecutor(sliding_window=8), **kw)

    ref = engine(num_gpu_blocks=256)
    _workload(ref, n_req=4, n=2)
    eng = engine(num_gpu_blocks=20, max_num_batched_tokens=32, num_host_blocks=64,
                 preemption_mode="swap")
    _workload(eng, n_req=4, n=2)
    got = kit.run(eng)
    assert eng.stats()["kv_host_swap_outs"] > 0
    assert _tokens(got) == _tokens(kit.run(ref))
    kit.assert_idle(eng)


def test_aborting_a_swapped_request_frees_its_host_blocks(kit) -> None:
    eng = kit.make_engine(num_gpu_blocks=14, max_num_batched_tokens=32, num_host_blocks=64,
                          preemption_mode="swap")
    _workload(eng)
    while not eng.kv.host.swapped:
        eng.step()
    (rid,) = list(eng.kv.host.swapped)[:1]
    group = rid.split("#")[0]
    out = eng.abort_request(group)
    assert out is not None and out.finished
    assert not eng.kv.is_swapped(rid)
    eng.kv.check_integrity()
    kit.run(eng)
    kit.assert_idle(eng)


def _shared_prefix_workload(eng, rounds: int = 3, families: int = 4) -> None:
    """Families of prompts sharing a 24-token prefix, visited round-robin: together their
    prefixes (4 x 6 blocks) exceed the 16-block device pool, so by the time a family comes
    back its blocks were evicted from the device."""
    heads = [prompt(100 * f + 1, 24) for f in range(families)]
    params = SamplingParams(max_tokens=4)
    for r in range(rounds):
        for f, head in enumerate(heads):
            eng.add_request(f"f{f}-{r}", head + prompt(500 + 10 * r + f, 3), params)
            kit_run_one(eng)


def kit_run_one(eng) -> None:
    while eng.has_unfinished():
        eng.step()
        eng.kv.check_integrity()


def test_evicted_prefix_blocks_are_hit_in_the_host_tier(kit) -> None:
    rates = {}
    outs = {}
    for name, host in (("off", None), ("on", 64)):
        eng = kit.make_engine(num_gpu_blocks=17, num_host_blocks=host)
        _shared_prefix_workload(eng)
        stats = eng.stats()
        rates[name] = stats["prefix_cache_hits"] / stats["prefix_cache_queries"]
        outs[name] = stats
        kit.assert_idle(eng)
    on = outs["on"]
    assert on["prefix_cache_host_hits"] > 0 and on["kv_host_offloaded_blocks"] > 0
    assert on["prefix_cache_hits"] == on["prefix_cache_device_hits"] + on["prefix_cache_host_hits"]
    assert outs["off"]["prefix_cache_host_hits"] == 0
    assert rates["on"] >= 2 * rates["off"]


def test_offload_can_be_switched_off_while_swapping(kit) -> None:
    eng = kit.make_engine(num_gpu_blocks=17, num_host_blocks=64, kv_offload=False)
    _shared_prefix_workload(eng, rounds=2)
    stats = eng.stats()
    assert stats["prefix_cache_host_hits"] == 0 and stats["kv_host_offloaded_blocks"] == 0
    kit.assert_idle(eng)


def test_worker_failure_mid_swap_resumes_requests_by_recompute(kit) -> None:
    class DiesMidCopy(kit.FakeExecutor):
        armed = True

        def execute(self, so):
            if self.armed and so.blocks_to_device:
                self.armed = False
                raise WorkerGroupError(0, "node-z", "died while copying KV blocks")
            return super().execute(so)

    swap = {"num_gpu_blocks": 14, "max_num_batched_tokens": 32, "num_host_blocks": 64,
            "preemption_mode": "swap"}
    ref = kit.make_engine(**swap)
    _workload(ref)
    expected = kit.run(ref)
    ex = DiesMidCopy()
    eng = kit.make_engine(executor=ex, **swap)
    eng.core.restarts.backoff_s = 0.0
    _workload(eng)
    done = {}
    while ex.armed:
        done |= {o.request_id: o for o in eng.step() if o.finished}
    # The host blocks died with the group: the swapped requests start over on the new one
    # (the fake worker fails any read of a host block the rebuilt group never wrote).
    assert eng.kv.host.num_free_blocks == eng.kv.host.num_usable_blocks
    assert eng.stats()["kv_blocks_used"] == 0
    done |= kit.run(eng)
    assert not [o for o in done.values() if o.error] and _tokens(done) == _tokens(expected)
    kit.assert_idle(eng)
    # The engine swaps as before afterwards.
    _workload(eng)
    kit.run(eng)
    assert eng.stats()["kv_host_swap_ins"] > 0 and ex.restarts == 1
    kit.assert_idle(eng)


def test_bad_tier_options_are_typed_errors() -> None:
    with pytest.raises(ConfigError, match="preemption_mode"):
        from_flat(preemption_mode="spill")
    with pytest.raises(ConfigError, match="host_kv_cache_bytes"):
        from_flat(host_kv_cache_bytes=-1)
    with pytest.raises(ConfigError, match="needs a host KV tier"):
        from_flat(preemption_mode="swap")
    with pytest.raises(ConfigError, match="num_host_blocks"):
        from_flat(num_host_blocks=1)
    cfg = from_flat(preemption_mode="swap", host_kv_cache_bytes=1 << 20)
    assert cfg.cache.host_tier_enabled and cfg.scheduler.preemption_mode == "swap"
