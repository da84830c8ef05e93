"""EngineCore set-up, input validation, wire cleanliness and statistics."""

from __future__ import annotations

import sys

import pytest
from helpers.driver import drive

from pagedserve.config import from_flat
from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    InvalidTokenError,
    PromptTooLongError,
    RequestError,
    RequestTooLargeError,
    UnsupportedRequestError,
)
from pagedserve.controller.executor import LocalExecutor
from pagedserve.controller.request import child_seed
from pagedserve.kv.errors import RequestTooLargeError as KVRequestTooLargeError
from pagedserve.messages import (
    KVCacheLayout,
    SamplingParams,
    SchedulerOutput,
    decode,
    encode,
)


def test_init_plans_kv_cache_from_worker_report(kit):
    fake = kit.FakeExecutor(max_model_len=128, available_kv_bytes=1 << 20, num_layers=3)
    eng = kit.make_engine(executor=fake, num_gpu_blocks=None, max_model_len=512)
    # Page = 2 (K,V) * 4 tokens * 2 heads * 8 dims * 2 bytes = 256 B; 3 layers in one group.
    assert fake.layout == KVCacheLayout(
        num_blocks=(1 << 20) // 256 // 3, block_size=4, groups=[[0, 1, 2]]
    )
    assert eng.max_model_len == 128  # never more than the model supports
    eng2 = kit.make_engine(executor=kit.FakeExecutor(max_model_len=128), max_model_len=64)
    assert eng2.max_model_len == 64
    assert eng2.executor.layout.num_blocks == 64  # num_gpu_blocks wins over the byte budget
    eng2.shutdown()
    assert eng2.executor.shut


def test_bad_requests_raise_typed_errors_and_leave_others_alone(kit):
    eng = kit.make_engine(num_gpu_blocks=9, max_model_len=64)  # 8 usable blocks = 32 tokens
    eng.add_request("ok", [1, 2, 3, 4, 5], SamplingParams(max_tokens=6))
    eng.step()
    before = (eng.kv.usage, len(eng.scheduler.requests), len(eng.scheduler.waiting))
    bad = [
        (EmptyPromptError, "e", [], SamplingParams()),
        (PromptTooLongError, "l", [1] * 65, SamplingParams()),
        (InvalidTokenError, "v1", [1, 1000], SamplingParams()),
        (InvalidTokenError, "v2", [-1, 2], SamplingParams()),
        (InvalidTokenError, "v3", [1, 2.5], SamplingParams()),
        (RequestTooLargeError, "big", [1] * 20, SamplingParams(max_tokens=30)),
        (DuplicateRequestError, "ok", [1, 2], SamplingParams()),
        (UnsupportedRequestError, "s", [1, 2], SamplingParams(stop=["x"])),  # no tokenizer
        (UnsupportedRequestError, "n", [1, 2], SamplingParams(n=17)),
    ]
    for err, rid, ids, params in bad:
        with pytest.raises(err) as info:
            eng.add_request(rid, ids, params)
        assert isinstance(info.value, RequestError)
        assert (eng.kv.usage, len(eng.scheduler.requests), len(eng.scheduler.waiting)) == before
        assert rid == "ok" or rid not in eng.scheduler.requests
    # Never-fits also matches kv's own error type.
    with pytest.raises(KVRequestTooLargeError):
        eng.add_request("big", [1] * 20, SamplingParams(max_tokens=None))
    # Fits exactly: 20 + 13 - 1 = 32 token slots.
    eng.add_request("edge", [1] * 20, SamplingParams(max_tokens=13))
    done = kit.run(eng)
    assert len(done["ok"].outputs[0].token_ids) == 6
    assert len(done["edge"].outputs[0].token_ids) == 13
    kit.assert_idle(eng)


def test_duplicate_of_internal_child_id(kit):
    eng = kit.make_engine()
    eng.add_request("x", [1, 2, 3], SamplingParams(n=2))
    with pytest.raises(DuplicateRequestError):
        eng.add_request("x#1", [1, 2, 3], SamplingParams())
    with pytest.raises(DuplicateRequestError):
        eng.add_request("x", [4], SamplingParams())


def _mixed_workload(eng):
    eng.add_request("a", list(range(1, 30)), SamplingParams(max_tokens=5))
    eng.add_request("b", list(range(1, 31)), SamplingParams(n=3, max_tokens=4, seed=7))
    eng.add_request("c", [9, 8, 7], SamplingParams(max_tokens=3, logprobs=2))


def test_every_scheduler_output_round_trips_the_codec(kit):
    eng = kit.make_engine(num_gpu_blocks=14, max_num_batched_tokens=16)
    _mixed_workload(eng)
    kit.run(eng)
    outs = eng.executor.outputs
    assert outs and any(o.block_copies for o in outs) and any(o.finished_req_ids for o in outs)
    for so in outs:
        back = decode(encode(so))
        assert isinstance(back, SchedulerOutput)
        assert encode(back) == encode(so)
        assert back.new_reqs == so.new_reqs and back.cached_reqs == so.cached_reqs


def test_step_outputs_and_stats(kit):
    eng = kit.make_engine()
    _mixed_workload(eng)
    seen_partial = False
    finals = {}
    while eng.has_unfinished():
        for out in eng.step():
            assert out.request_id in "abc"
            seen_partial |= not out.finished
            if out.finished:
                finals[out.request_id] = out
    assert seen_partial
    assert [len(c.token_ids) for c in finals["b"].outputs] == [4, 4, 4]
    stats = eng.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_usage"] == 0.0 and stats["num_steps"] > 0
    assert stats["prefix_cache_queries"] > 0 and stats["prefix_cache_hits"] > 0
    assert eng.step() == []


def test_final_only_requests_get_one_delta_with_everything(kit):
    """``final_only`` (``LLM.generate``'s requests) changes when outputs travel, not what they
    say: the same workload, n=3, logprobs and an abort included, gives the same final outputs
    as per-step deltas, in one delta per request."""

    def run(final_only: bool) -> tuple[dict, dict[str, int]]:
        eng = kit.make_engine(num_gpu_blocks=14, max_num_batched_tokens=16)
        eng.add_request("a", list(range(1, 30)), SamplingParams(max_tokens=5),
                        final_only=final_only)
        eng.add_request("b", list(range(1, 31)), SamplingParams(n=3, max_tokens=4, seed=7),
                        final_only=final_only)
        eng.add_request("c", [9, 8, 7], SamplingParams(max_tokens=3, logprobs=2),
                        final_only=final_only)
        eng.add_request("d", [5, 6], SamplingParams(max_tokens=50), final_only=final_only)
        deltas: dict[str, int] = {}
        finals = {}
        for step in range(1000):
            if not eng.has_unfinished():
                break
            raw = eng.core.step()
            for delta in raw:
                deltas[delta.request_id] = deltas.get(delta.request_id, 0) + 1
            for out in eng.collector.feed(raw):
                if out.finished:
                    finals[out.request_id] = out
            if step == 6:
                out = eng.abort_request("d")
                deltas["d"] = deltas.get("d", 0) + 1
                finals["d"] = out
        return finals, deltas

    streamed, streamed_deltas = run(False)
    final, final_deltas = run(True)
    assert final == streamed
    assert len(final["d"].outputs[0].token_ids) > 0  # the abort still sends what was made
    assert final_deltas == {"a": 1, "b": 1, "c": 1, "d": 1}
    assert all(streamed_deltas[r] > 1 for r in "abcd")


def test_step_hook_sees_block_fill(kit):
    eng = kit.make_engine(block_size=4)
    fills = []
    eng.add_step_hook(lambda sched, so: fills.append(int(sched.kv.block_fill_snapshot().sum())))
    eng.add_request("a", list(range(1, 11)), SamplingParams(max_tokens=3))
    kit.run(eng)
    assert fills[:3] == [10, 11, 12]


def test_logprobs_are_recorded(kit):
    class LogprobExecutor(kit.FakeExecutor):
        def execute(self, so):
            out = super().execute(so)
            out.logprobs = [[([t, 1], [-0.5, -1.0])] for (t,) in out.sampled_token_ids]
            return out

    eng = kit.make_engine(executor=LogprobExecutor())
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2, logprobs=1))
    c = kit.run(eng)["a"].outputs[0]
    assert c.cumulative_logprob == -1.0 and len(c.logprobs) == 2


def test_child_seeds():
    assert child_seed(5, 0) == 5 and child_seed(None, 3) is None
    assert child_seed(5, 1) == 5 + 1_000_003
    assert child_seed(2**63 - 1, 2) < 2**63


def test_collective_rpc_calls_a_worker_method_by_name(kit):
    class Scaling(kit.FakeExecutor):
        def scale(self, x, *, by=1):
            """A worker operation that nothing but this method declares."""
            return (x * by, len(self.outputs))

    cfg = from_flat(block_size=4)
    eng = drive(EngineCore(cfg, LocalExecutor(lambda: Scaling(vocab_size=50, max_model_len=32))))
    assert eng.executor.collective_rpc("scale", (3,), {"by": 2}) == [(6, 0)]
    eng.add_request("a", [3, 4, 5], SamplingParams(max_tokens=2))
    while eng.has_unfinished():
        eng.step()
    # Between steps, on the same worker the steps ran on; its own errors come back as they are.
    assert eng.executor.collective_rpc("scale", (1,)) == [(1, 2)]
    with pytest.raises(AttributeError):
        eng.executor.collective_rpc("no_such_operation")
    eng.shutdown()


def test_local_executor_runs_the_worker_its_factory_makes_and_rebuilds_it(kit):
    cfg = from_flat(block_size=4)
    made: list = []  # every worker the factory made; the fake stands in for one

    def make_worker():
        made.append(kit.FakeExecutor(vocab_size=50, max_model_len=32))
        return made[-1]

    eng = drive(EngineCore(cfg, LocalExecutor(make_worker)))
    worker = made[-1]
    assert worker.layout.block_size == 4 and eng.max_model_len == 32
    eng.add_request("a", [3, 4, 5], SamplingParams(max_tokens=3))
    while eng.has_unfinished():
        eng.step()
    assert worker.outputs and all(isinstance(so, SchedulerOutput) for so in worker.outputs)
    # A restart shuts the worker down and makes a new one with the same KV layout.
    eng.executor.restart()
    assert worker.shut and made[-1] is not worker
    assert made[-1].layout == worker.layout
    eng.shutdown()
    assert worker.shut


def test_controller_does_not_import_torch():
    import subprocess

    code = (
        "import sys; import pagedserve.controller.engine_core, pagedserve.controller.executor;"
        "import pagedserve.controller.scheduler; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
