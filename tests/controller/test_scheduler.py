"""Scheduling behaviour end to end through EngineCore and the fake executor."""

from __future__ import annotations

import pathlib

import pytest

from pagedserve.controller.request import RequestStatus
from pagedserve.messages import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def prompt(start: int, n: int) -> list[int]:
    return [(start + i) % 997 + 1 for i in range(n)]


def last_out(eng):
    return eng.executor.outputs[-1]


def test_running_first_budget_packing(kit):
    eng = kit.make_engine(max_num_batched_tokens=10, enable_prefix_caching=False)
    eng.add_request("a", prompt(0, 6), GREEDY)
    eng.add_request("b", prompt(100, 6), GREEDY)
    eng.step()
    assert last_out(eng).num_scheduled_tokens == {"a": 6, "b": 4}  # b's prompt is chunked
    eng.add_request("c", prompt(200, 20), GREEDY)
    eng.step()
    # Running first: a decodes, b finishes its prompt, c gets what is left of the budget.
    assert list(last_out(eng).num_scheduled_tokens.items()) == [("a", 1), ("b", 2), ("c", 7)]
    eng.step()
    assert list(last_out(eng).num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 8)]
    kit.run(eng)
    kit.assert_idle(eng)


def test_max_num_seqs_limits_running(kit):
    eng = kit.make_engine(max_num_seqs=2)
    for i in range(4):
        eng.add_request(str(i), prompt(10 * i, 5), GREEDY)
    eng.step()
    assert set(last_out(eng).num_scheduled_tokens) == {"0", "1"}
    assert eng.stats()["num_waiting"] == 2
    assert len(kit.run(eng)) == 4


def test_one_chunked_prefill_and_several_decodes_in_one_step(kit):
    eng = kit.make_engine(max_num_batched_tokens=16)
    for i in range(3):
        eng.add_request(f"d{i}", prompt(50 * i, 4), SamplingParams(max_tokens=20))
    eng.step()
    eng.add_request("long", prompt(500, 40), SamplingParams(max_tokens=2))
    outs = eng.step()
    so = last_out(eng)
    assert so.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "long": 13}
    assert [r.req_id for r in so.new_reqs] == ["long"]
    assert so.cached_reqs.req_ids == ["d0", "d1", "d2"]
    # The decodes sampled; the partial prefill did not.
    assert sorted(o.request_id for o in outs) == ["d0", "d1", "d2"]
    assert all(len(o.outputs[0].token_ids) == 2 for o in outs)


def test_priority_policy_admits_the_most_urgent_first_and_preempts_the_least(kit):
    eng = kit.make_engine(max_num_seqs=2, scheduling_policy="priority")
    # Arrival order a, b, c, d; priority (lower first) 5, 1, 1, 0: d, then b before c.
    for i, (rid, prio) in enumerate([("a", 5), ("b", 1), ("c", 1), ("d", 0)]):
        eng.add_request(rid, prompt(10 * i, 5), GREEDY, arrival_time=float(i), priority=prio)
    eng.step()
    assert list(last_out(eng).num_scheduled_tokens) == ["d", "b"]
    assert [r.request_id for r in eng.scheduler.waiting] == ["c", "a"]
    assert len(kit.run(eng)) == 4
    kit.assert_idle(eng)

    # Under KV pressure the victim is the least urgent running request, not the newest.
    eng = kit.make_engine(num_gpu_blocks=9, max_num_batched_tokens=64,
                          scheduling_policy="priority")
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eng.add_request("low", prompt(0, 8), long, arrival_time=0.0, priority=9)
    eng.add_request("high", prompt(300, 8), long, arrival_time=1.0, priority=0)
    victims = []
    while eng.has_unfinished():
        running = [r.request_id for r in eng.scheduler.running]
        before = eng.stats()["num_preemptions"]
        eng.step()
        if eng.stats()["num_preemptions"] > before:
            victims += [rid for rid in running
                        if rid not in [r.request_id for r in eng.scheduler.running]]
    assert victims and set(victims) == {"low"}
    kit.assert_idle(eng)


def test_priority_needs_the_priority_policy(kit):
    from pagedserve.controller.errors import UnsupportedRequestError

    eng = kit.make_engine()
    with pytest.raises(UnsupportedRequestError, match="priority 3 needs"):
        eng.add_request("x", prompt(0, 4), GREEDY, priority=3)
    eng.add_request("y", prompt(0, 4), GREEDY, priority=0)
    assert len(kit.run(eng)) == 1


def test_no_prefill_phase_flag_in_controller():
    root = pathlib.Path(__file__).resolve().parents[2] / "controller"
    for path in root.glob("*.py"):
        assert "is_prefill" not in path.read_text(), path


def test_prefix_hit_reduces_scheduled_tokens(kit):
    eng = kit.make_engine()
    p = prompt(7, 20)
    eng.add_request("a", p, GREEDY)
    first = kit.run(eng)["a"]
    assert first.num_cached_tokens == 0
    eng.add_request("b", p, GREEDY)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
        if len(eng.executor.outputs) and "b" in eng.executor.outputs[-1].num_scheduled_tokens:
            break
    # Hit: 16 of 20 tokens (block aligned, at most num_tokens - 1).
    assert eng.executor.outputs[-1].num_scheduled_tokens == {"b": 4}
    assert eng.executor.outputs[-1].new_reqs[0].num_computed_tokens == 16
    second = kit.run(eng)["b"]
    assert second.num_cached_tokens == 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    stats = eng.stats()
    assert stats["prefix_cache_hits"] == 16 and stats["prefix_cache_queries"] == 40
    # A different cache salt isolates the tenant: no hit.
    eng.add_request("c", p, GREEDY, cache_salt="tenant-2")
    assert kit.run(eng)["c"].num_cached_tokens == 0
    kit.assert_idle(eng)


def _workload(eng, n_req=6, max_tokens=14):
    for i in range(n_req):
        eng.add_request(f"r{i}", prompt(37 * i, 6 + i), SamplingParams(max_tokens=max_tokens))


def test_preemption_by_recompute_gives_identical_outputs(kit):
    ref = kit.make_engine(num_gpu_blocks=256)
    _workload(ref)
    expected = kit.run(ref)

    eng = kit.make_engine(num_gpu_blocks=14, max_num_batched_tokens=32)
    _workload(eng)
    got = {}
    saw_resume = False
    while eng.has_unfinished():
        before = eng.stats()["num_preemptions"]
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out
        eng.kv.check_integrity()
        so = eng.executor.outputs[-1]
        if eng.stats()["num_preemptions"] > before:
            # No admission in a step that preempted; the victims are dropped on the workers.
            assert not so.new_reqs
            assert so.finished_req_ids
        saw_resume |= any(nr.output_token_ids for nr in so.new_reqs)
    assert eng.stats()["num_preemptions"] > 0
    assert saw_resume, "a preempted request should resume with its output ids"
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {
        k: v.outputs[0].token_ids for k, v in expected.items()
    }
    kit.assert_idle(eng)


def test_preemption_without_prefix_caching(kit):
    ref = kit.make_engine(num_gpu_blocks=256, enable_prefix_caching=False)
    _workload(ref, n_req=5)
    eng = kit.make_engine(num_gpu_blocks=12, enable_prefix_caching=False)
    _workload(eng, n_req=5)
    a, b = kit.run(ref), kit.run(eng)
    assert eng.stats()["num_preemptions"] > 0
    assert {k: v.outputs[0].token_ids for k, v in a.items()} == {
        k: v.outputs[0].token_ids for k, v in b.items()
    }
    kit.assert_idle(eng)


def _used_blocks(eng) -> int:
    return eng.kv.pool.num_usable_blocks - eng.kv.num_free_blocks


def test_parallel_sampling_forks_and_shares_prompt_blocks(kit):
    eng = kit.make_engine(block_size=4)
    params = SamplingParams(n=4, max_tokens=6, seed=123)
    eng.add_request("r", prompt(3, 10), params)
    assert eng.step() == []  # the parent computes 9 of 10 prompt tokens; nothing sampled
    assert last_out(eng).num_scheduled_tokens == {"r": 9}
    # Forked: four children hold the parent's 3 blocks, counted once.
    assert _used_blocks(eng) == 3
    assert len(eng.scheduler.running) == 4
    outs = eng.step()
    so = last_out(eng)
    assert so.finished_req_ids == ["r"]
    assert [nr.req_id for nr in so.new_reqs] == [f"r#{i}" for i in range(4)]
    assert all(nr.num_computed_tokens == 9 for nr in so.new_reqs)
    assert so.num_scheduled_tokens == {f"r#{i}": 1 for i in range(4)}
    # The shared partial block is copied for three writers; the last one keeps it.
    assert len(so.block_copies) == 3
    assert len({dst for _, dst in so.block_copies}) == 3
    assert {src for src, _ in so.block_copies} == {so.new_reqs[-1].block_ids[0][2]}
    assert _used_blocks(eng) == 2 + 4
    assert len(outs) == 1 and len(outs[0].outputs) == 4
    final = kit.run(eng)["r"]
    seqs = [c.token_ids for c in final.outputs]
    assert len({tuple(s) for s in seqs}) == 4, "children must sample independently"
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    kit.assert_idle(eng)

    # Reproducible, and completion 0 equals an n=1 request with the same seed.
    again = kit.make_engine(block_size=4)
    again.add_request("r", prompt(3, 10), params)
    assert [c.token_ids for c in kit.run(again)["r"].outputs] == seqs
    single = kit.make_engine(block_size=4)
    single.add_request("s", prompt(3, 10), SamplingParams(max_tokens=6, seed=123))
    assert kit.run(single)["s"].outputs[0].token_ids == seqs[0]


def test_fork_edge_cases(kit):
    eng = kit.make_engine(block_size=4)
    # prompt - 1 block aligned: no copy needed, each child appends its own block.
    eng.add_request("aligned", prompt(1, 9), SamplingParams(n=3, max_tokens=3, seed=1))
    eng.step()
    eng.step()
    assert last_out(eng).block_copies == []
    # One-token prompt: nothing to share, the children start directly.
    eng.add_request("one", [5], SamplingParams(n=2, max_tokens=3, seed=2))
    done = kit.run(eng)
    assert all(len(c.token_ids) == 3 for c in done["one"].outputs)
    assert all(len(c.token_ids) == 3 for c in done["aligned"].outputs)
    # Whole parent share cached: the parent dissolves, each child hits the cache.
    eng.add_request("again", prompt(1, 9), SamplingParams(n=3, max_tokens=3, seed=1))
    again = kit.run(eng)["again"]
    assert again.num_cached_tokens == 8
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in done["aligned"].outputs]
    kit.assert_idle(eng)


def test_fork_under_memory_pressure(kit):
    ref = kit.make_engine(num_gpu_blocks=256)
    eng = kit.make_engine(num_gpu_blocks=10, max_num_batched_tokens=16)
    for e in (ref, eng):
        e.add_request("x", prompt(11, 10), SamplingParams(n=4, max_tokens=10, seed=9))
        e.add_request("y", prompt(90, 7), SamplingParams(max_tokens=10))
    a, b = kit.run(ref), kit.run(eng)
    assert eng.stats()["num_preemptions"] > 0
    for rid in ("x", "y"):
        assert [c.token_ids for c in a[rid].outputs] == [c.token_ids for c in b[rid].outputs]
    kit.assert_idle(eng)


def _baseline_other(kit):
    ref = kit.make_engine()
    ref.add_request("other", prompt(400, 7), SamplingParams(max_tokens=12))
    return kit.run(ref)["other"].outputs[0].token_ids


def test_abort_at_any_point_frees_everything(kit):
    expected_other = _baseline_other(kit)
    cases = {
        "waiting": 0,  # aborted before its first step
        "mid_prefill": 1,  # budget 8 < 30-token prompt: still prefilling after one step
        "running": 6,
    }
    for name, steps in cases.items():
        for params in (SamplingParams(max_tokens=50), SamplingParams(n=3, max_tokens=50, seed=4)):
            eng = kit.make_engine(max_num_batched_tokens=8, max_num_seqs=8)
            eng.add_request("other", prompt(400, 7), SamplingParams(max_tokens=12))
            eng.add_request("victim", prompt(600, 30), params)
            for _ in range(steps):
                eng.step()
            out = eng.abort_request("victim")
            assert out is not None and out.finished, name
            assert all(c.finish_reason == "abort" for c in out.outputs), name
            assert eng.abort_request("victim") is None
            victim_ids = ["victim", *(f"victim#{i}" for i in range(3))]
            assert not any(eng.kv.has_request(i) for i in victim_ids), name
            assert not any(i in eng.scheduler.requests for i in victim_ids), name
            eng.kv.check_integrity()
            done = kit.run(eng)
            assert done["other"].outputs[0].token_ids == expected_other, name
            kit.assert_idle(eng)
            # The workers were told to drop it (or never knew it).
            assert not any(r.startswith("victim") for r in eng.executor.rows)


def test_abort_after_fork_and_readd_same_id(kit):
    eng = kit.make_engine()
    eng.add_request("v", prompt(1, 10), SamplingParams(n=4, max_tokens=30, seed=3))
    for _ in range(3):
        eng.step()
    assert len(eng.scheduler.running) == 4
    eng.abort_request("v")
    assert eng.kv.usage == 0.0
    assert not eng.scheduler.running and not eng.scheduler.requests
    # The same id can be used again at once; the workers drop the old one first.
    eng.add_request("v", prompt(1, 10), SamplingParams(max_tokens=3))
    done = kit.run(eng)
    assert len(done["v"].outputs[0].token_ids) == 3
    kit.assert_idle(eng)


def test_request_status_lifecycle(kit):
    eng = kit.make_engine(max_num_batched_tokens=4)
    eng.add_request("a", prompt(0, 10), GREEDY)
    req = eng.scheduler.requests["a"]
    assert req.status == RequestStatus.WAITING
    eng.step()
    assert req.status == RequestStatus.RUNNING and req.num_computed_tokens == 4
    kit.run(eng)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and req.finish_reason == "length"


def _xyz(eng):
    eng.add_request("x", prompt(1, 10), SamplingParams(n=3, max_tokens=12, seed=1))
    eng.add_request("y", prompt(50, 7), SamplingParams(max_tokens=12))
    eng.add_request("z", prompt(80, 9), SamplingParams(max_tokens=12))


def _tokens(done):
    return {k: [c.token_ids for c in v.outputs] for k, v in done.items()}


def test_reserve_policy_matches_paged(kit):
    ref = kit.make_engine(max_model_len=32)
    _xyz(ref)
    expected = _tokens(kit.run(ref))
    # reserve: 8 blocks per sequence at admission (prefix hits among them); 20 usable blocks
    # hold two or three of the five sequences at once.
    eng = kit.make_engine(num_gpu_blocks=21, max_model_len=32, allocation_policy="reserve")
    _xyz(eng)
    max_running = 0
    while eng.has_unfinished():
        eng.step()
        max_running = max(max_running, len(eng.scheduler.running))
        eng.kv.check_integrity()
    assert 2 <= max_running <= 3
    eng2 = kit.make_engine(num_gpu_blocks=21, max_model_len=32, allocation_policy="reserve")
    _xyz(eng2)
    assert _tokens(kit.run(eng2)) == expected
    kit.assert_idle(eng2)


def test_block_replacement_of_a_running_request_is_resent(kit):
    # Force a fork under ``reserve``: children then share empty reserved blocks and each later
    # write replaces one of them while the child is already on the workers.
    ref = kit.make_engine(max_model_len=32)
    _xyz(ref)
    expected = _tokens(kit.run(ref))
    eng = kit.make_engine(num_gpu_blocks=64, max_model_len=32, allocation_policy="reserve")
    eng.kv.capacity.policy = "paged"
    _xyz(eng)
    eng.kv.capacity.policy = "reserve"
    got = _tokens(kit.run(eng))
    assert got == expected
    resends = [
        so
        for so in eng.executor.outputs
        if {nr.req_id for nr in so.new_reqs} & set(so.finished_req_ids)
    ]
    assert resends
    kit.assert_idle(eng)


def test_sliding_window_hybrid_model(kit):
    fake = kit.FakeExecutor(num_layers=4, sliding_window=8)
    eng = kit.make_engine(executor=fake, num_gpu_blocks=40, max_num_batched_tokens=8)
    assert len(fake.layout.groups) == 2
    ref = kit.make_engine(executor=kit.FakeExecutor(num_layers=4, sliding_window=8))
    for e in (eng, ref):
        for i in range(4):
            e.add_request(f"s{i}", prompt(100 * i, 20), SamplingParams(max_tokens=30))
    assert _tokens(kit.run(eng)) == _tokens(kit.run(ref))
    kit.assert_idle(eng)


def test_several_decode_passes_only_where_nothing_else_could_use_the_step(kit):
    """``num_scheduler_steps`` passes while at most four requests run, all decoding, and none
    waits; the lookahead slots are allocated for them; one pass otherwise."""
    eng = kit.make_engine(num_scheduler_steps=4, max_num_seqs=2, block_size=4)
    eng.add_request("a", prompt(0, 6), SamplingParams(max_tokens=11, seed=1))
    eng.step()
    assert last_out(eng).num_decode_steps == 1  # a prefill
    outs = eng.step()
    so = last_out(eng)
    assert so.num_decode_steps == 4 and so.num_scheduled_tokens == {"a": 1}
    # Position 6 is computed, 7-9 are the lookahead: three blocks of 4 hold them.
    assert len(eng.kv.get_block_ids("a")[0]) == 3
    assert len(outs[0].outputs[0].token_ids) == 1 + 4
    eng.add_request("b", prompt(50, 3), SamplingParams(max_tokens=2, seed=2))
    eng.add_request("c", prompt(90, 3), SamplingParams(max_tokens=2, seed=3))
    eng.step()  # b is admitted (its prefill), c waits for a seat
    eng.step()
    assert last_out(eng).num_decode_steps == 1  # c still waits: b ends after this step
    done = kit.run(eng)
    assert len(done["a"].outputs[0].token_ids) == 11  # a's last step ran 3 passes of 4
    assert [so.num_decode_steps for so in eng.executor.outputs[-2:]] == [1, 4]
    kit.assert_idle(eng)

    five = kit.make_engine(num_scheduler_steps=4, max_num_seqs=8)
    for i in range(5):
        five.add_request(f"r{i}", prompt(10 * i, 3), SamplingParams(max_tokens=3, seed=i))
    kit.run(five)
    assert {so.num_decode_steps for so in five.executor.outputs} == {1}
