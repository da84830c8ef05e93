"""Admission agrees with allocation: whatever the layer kinds, pool, block size and budget, a
request admitted alone into an empty cache finishes, and one that cannot is refused at
admission; a step that could never make progress fails its request instead of spinning."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.controller.errors import RequestTooLargeError
from pagedserve.messages import SamplingParams


def test_sliding_window_prefill_larger_than_the_pool_is_chunked_to_fit(kit):
    # The steady state (full blocks + the window's) fits 12 blocks of 8; a whole-prompt
    # prefill would allocate every prompt block in the sliding group too, and does not.
    fake = kit.FakeExecutor(num_layers=2, sliding_window=16, max_model_len=512)
    eng = kit.make_engine(block_size=8, num_gpu_blocks=13, max_num_batched_tokens=64,
                          executor=fake)
    eng.add_request("a", list(range(1, 60)), SamplingParams(max_tokens=4, ignore_eos=True))
    done = kit.run(eng, max_steps=200)
    assert done["a"].outputs[0].finish_reason == "length"
    assert len(done["a"].outputs[0].token_ids) == 4
    kit.assert_idle(eng)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(["full", "sliding", "hybrid"]),
    window=st.integers(2, 40),
    block_size=st.sampled_from([2, 4, 8, 16]),
    num_blocks=st.integers(3, 40),
    budget=st.integers(1, 64),
    prompt_len=st.integers(1, 120),
    max_tokens=st.integers(1, 12),
    caching=st.booleans(),
)
def test_admitted_alone_always_finishes_or_is_refused(
    kit, kind, window, block_size, num_blocks, budget, prompt_len, max_tokens, caching
):
    fake = kit.FakeExecutor(
        num_layers=2, max_model_len=256,
        sliding_window=None if kind == "full" else window, all_sliding=kind == "sliding",
    )
    eng = kit.make_engine(block_size=block_size, num_gpu_blocks=num_blocks,
                          max_num_batched_tokens=budget, max_model_len=256,
                          enable_prefix_caching=caching, executor=fake)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompt = [(7 * i) % 997 + 1 for i in range(prompt_len)]
    try:
        eng.add_request("r", prompt, params)
    except RequestTooLargeError:
        return  # refused up front: nothing queued
    done = kit.run(eng, max_steps=4000)
    out = done["r"]
    assert out.error is None, out.error
    assert len(out.outputs[0].token_ids) == max_tokens
    kit.assert_idle(eng)
    # The same prompt again, now possibly with prefix hits, still finishes.
    eng.add_request("again", prompt, params)
    assert kit.run(eng, max_steps=4000)["again"].error is None


def test_a_step_that_cannot_progress_fails_the_head_request(kit, caplog):
    eng = kit.make_engine()
    eng.add_request("stuck", [5, 6, 7], SamplingParams(max_tokens=3))
    eng.add_request("next", [8, 9], SamplingParams(max_tokens=3))
    # An allocator that never finds room: admission promised otherwise.
    eng.scheduler.kv.allocate_slots = lambda *a, **k: None
    (out,) = eng.step()
    assert out.request_id == "stuck" and out.finished
    assert out.error and "cannot be scheduled in an empty cache" in out.error
    assert out.outputs[0].finish_reason == "error"
    assert "stuck" in caplog.text
    # The next request is the new head: it fails the same way on the next step, no spin.
    (out,) = eng.step()
    assert out.request_id == "next" and out.error
    assert not eng.has_unfinished()
