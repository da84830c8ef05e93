"""Worker behaviour beyond greedy parity: reports, partial prefills, prefix hits, preemption,
copy-on-write, logprobs and seeded sampling through the whole step."""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.messages import (
    PLACEHOLDER_TOKEN,
    CachedRequestData,
    KVCacheLayout,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from pagedserve.workers.worker import CPU_DEFAULT_KV_BYTES, Worker

B = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPT = [1, 17, 99, 4, 250, 31, 77, 8, 300, 41, 42, 5]


def worker_for(path, layout_blocks: int = 64, kv_bytes: int | None = 1 << 24) -> Worker:
    w = Worker(
        EngineConfig(
            model=ModelConfig(model=str(path), dtype="float32"),
            cache=CacheConfig(block_size=B, kv_cache_memory_bytes=kv_bytes),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        )
    )
    report = w.load_model()
    layers = list(range(len(report.layer_specs)))
    w.init_kv_cache(KVCacheLayout(layout_blocks, B, [layers]))
    return w


@pytest.fixture(scope="module")
def llama(checkpoint_dir):
    return checkpoint_dir("llama")


@pytest.fixture(scope="module")
def hf_llama(llama, checkpoints):
    return checkpoints.load_hf_model(llama)


def test_report(llama, checkpoint_dir):
    w = Worker(EngineConfig(model=ModelConfig(model=str(llama), max_model_len=300)))
    report = w.load_model()
    assert report.available_kv_bytes == CPU_DEFAULT_KV_BYTES  # CPU default: 1 GiB
    assert report.vocab_size == 512 and report.max_model_len == 300 and report.device == "cpu"
    assert len(report.layer_specs) == 2
    assert all(
        (s.num_kv_heads, s.head_size, s.dtype_bytes, s.sliding_window) == (2, 16, 4, None)
        for s in report.layer_specs
    )
    with pytest.raises(RuntimeError):
        w.execute(SchedulerOutput(step_id=0))
    hybrid = Worker(EngineConfig(model=ModelConfig(model=str(checkpoint_dir("hybrid")))))
    assert [s.sliding_window for s in hybrid.load_model().layer_specs] == [8, None, 8, None]


def test_placeholders_take_the_rows_own_samples(llama, hf_llama, checkpoints):
    """Async scheduling: each step goes out before the controller has the step before's
    token, as a placeholder the worker fills with its own sample. Two requests decode that
    way; a third's known token arrives as usual in the same steps."""
    w = worker_for(llama)
    other = PROMPT[::-1]
    new = [NewRequestData("a", PROMPT, [], GREEDY, [[1, 2, 3, 4, 5, 6]], 0),
           NewRequestData("b", other, [], GREEDY, [[7, 8, 9, 10, 11, 12]], 0)]
    out = w.execute(SchedulerOutput(0, new_reqs=new, num_scheduled_tokens={"a": 12, "b": 12}))
    got = {r: list(t) for r, t in zip(out.req_ids, out.sampled_token_ids, strict=True)}
    for step in range(1, 5):
        # "a" never tells the worker its token; "b" sends the one it got back.
        cached = CachedRequestData(["a", "b"], [[PLACEHOLDER_TOKEN], got["b"][-1:]],
                                   [None, None], [11 + step, 11 + step])
        out = w.execute(SchedulerOutput(step, cached_reqs=cached,
                                        num_scheduled_tokens={"a": 1, "b": 1}))
        for r, t in zip(out.req_ids, out.sampled_token_ids, strict=True):
            got[r] += t
    assert got["a"] == checkpoints.hf_greedy(hf_llama, PROMPT, 5)
    assert got["b"] == checkpoints.hf_greedy(hf_llama, other, 5)


def test_partial_prefill_then_prefix_hit(llama, hf_llama, checkpoints):
    w = worker_for(llama)
    blocks = [9, 4, 20]
    # Step 0: the first 5 prompt tokens only -> nothing sampled.
    new = NewRequestData("a", PROMPT, [], GREEDY, [blocks[:2]], 0)
    out = w.execute(SchedulerOutput(0, new_reqs=[new], num_scheduled_tokens={"a": 5}))
    assert out.req_ids == [] and out.sampled_token_ids == []
    # Step 1: the other 7 -> one token sampled.
    cached = CachedRequestData(["a"], [[]], [[blocks[2:]]], [5])
    out = w.execute(SchedulerOutput(1, cached_reqs=cached, num_scheduled_tokens={"a": 7}))
    expected = checkpoints.hf_greedy(hf_llama, PROMPT, 2)
    assert out.req_ids == ["a"] and out.sampled_token_ids == [[expected[0]]]
    # A second request sharing the first two full blocks starts at num_computed_tokens = 8.
    prompt_b = PROMPT[:8] + [123, 7]
    new_b = NewRequestData("b", prompt_b, [], GREEDY, [blocks[:2] + [33]], 8)
    cached = CachedRequestData(["a"], [[expected[0]]], [None], [12])
    out = w.execute(
        SchedulerOutput(
            2, new_reqs=[new_b], cached_reqs=cached, num_scheduled_tokens={"a": 1, "b": 2}
        )
    )
    assert dict(zip(out.req_ids, out.sampled_token_ids, strict=True)) == {
        "a": [expected[1]],
        "b": checkpoints.hf_greedy(hf_llama, prompt_b, 1)[:1],
    }


def test_preempted_request_resumes(llama, hf_llama, checkpoints, stepper_module):
    w = worker_for(llama)
    layout = KVCacheLayout(64, B, [[0, 1]])
    st = stepper_module.Stepper(w, layout, seed=5)
    st.add("a", PROMPT, 8)
    st.add("b", PROMPT[:5], 8)
    for _ in range(4):
        st.step()
    r = st.drop("a")  # preempted: the worker drops the row, the blocks are freed
    st.step()
    st.add("a", r.prompt, 8, output=r.output)  # resumed: prompt + outputs recomputed
    done = st.run()
    assert done["a"] == checkpoints.hf_greedy(hf_llama, PROMPT, 8)
    assert done["b"] == checkpoints.hf_greedy(hf_llama, PROMPT[:5], 8)


def test_block_copies_run_before_the_forward_pass(llama):
    w = worker_for(llama)
    kv = w.runner.kv_pool.tensors
    for t in kv:
        t[3].normal_()
    w.execute(SchedulerOutput(0, block_copies=[(3, 5)]))
    assert all(torch.equal(t[5], t[3]) for t in kv)


def test_logprobs(llama, hf_llama):
    w = worker_for(llama)
    sp = SamplingParams(temperature=0.0, logprobs=3)
    reqs = [
        NewRequestData("lp", PROMPT, [], sp, [[1, 2, 3]], 0),
        NewRequestData("none", PROMPT[:4], [], GREEDY, [[4]], 0),
    ]
    out = w.execute(SchedulerOutput(0, new_reqs=reqs, num_scheduled_tokens={"lp": 12, "none": 4}))
    ((ids, lps),) = out.logprobs[0]
    assert out.logprobs[1] is None
    with torch.no_grad():
        ref = hf_llama(torch.tensor([PROMPT])).logits[0, -1].log_softmax(-1)
    assert [ids[0]] == out.sampled_token_ids[0] == [ids[1]]  # greedy: sampled is the top-1
    assert ids[1:] == ref.topk(3).indices.tolist()
    assert lps == pytest.approx(ref[ids].tolist(), abs=1e-4)


def test_seeded_sampling_ignores_batch_composition(llama, stepper_module):
    layout = KVCacheLayout(64, B, [[0, 1]])
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10)

    def sample(with_neighbours: bool) -> list[int]:
        st = stepper_module.Stepper(worker_for(llama), layout, seed=int(with_neighbours))
        if with_neighbours:
            st.add("x", PROMPT[:3], 10, SamplingParams(temperature=0.8, max_tokens=10))
            st.add("y", PROMPT[2:9], 4, SamplingParams(temperature=1.0, seed=9, max_tokens=4))
        st.add("s", PROMPT, 10, sp)
        return st.run(budget=8 if with_neighbours else 64)["s"]

    alone, crowded = sample(False), sample(True)
    assert alone == crowded
    assert len(set(alone)) > 2


def test_seeded_request_resumed_after_preemption_continues_its_stream(llama, stepper_module):
    layout = KVCacheLayout(64, B, [[0, 1]])
    sp = SamplingParams(temperature=1.0, seed=77, max_tokens=8)
    st = stepper_module.Stepper(worker_for(llama), layout)
    st.add("s", PROMPT, 8, sp)
    uninterrupted = st.run()["s"]
    st = stepper_module.Stepper(worker_for(llama), layout)
    st.add("s", PROMPT, 8, sp)
    for _ in range(4):
        st.step()
    r = st.drop("s")
    st.step()
    st.add("s", r.prompt, 8, sp, output=r.output)
    assert st.run()["s"] == uninterrupted


def test_bfloat16_step_runs(llama):
    w = Worker(
        EngineConfig(
            model=ModelConfig(model=str(llama), dtype="bfloat16"),
            cache=CacheConfig(block_size=B, kv_cache_memory_bytes=1 << 24),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        )
    )
    report = w.load_model()
    assert report.layer_specs[0].dtype_bytes == 2
    w.init_kv_cache(KVCacheLayout(16, B, [[0, 1]]))
    assert w.runner.kv_pool.tensors[0].dtype == torch.bfloat16
    new = NewRequestData(
        "a", PROMPT, [], SamplingParams(temperature=0.7, logprobs=1), [[1, 2, 3]], 0
    )
    out = w.execute(SchedulerOutput(0, new_reqs=[new], num_scheduled_tokens={"a": 12}))
    assert 0 <= out.sampled_token_ids[0][0] < 512 and len(out.logprobs[0][0][0]) == 2


def test_min_tokens_masks_stop_tokens(llama, hf_llama):
    w = worker_for(llama)
    assert w.eos_token_ids == (2,)
    with torch.no_grad():
        ref = hf_llama(torch.tensor([PROMPT])).logits[0, -1]
    top = ref.topk(3).indices.tolist()
    # Make the greedy favourite a stop token: it is masked until min_tokens outputs exist.
    sp = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=(top[0],), logprobs=1)
    reqs = [
        NewRequestData("m", PROMPT, [], sp, [[1, 2, 3]], 0),
        NewRequestData("free", PROMPT, [], GREEDY, [[4, 5, 6]], 0),
    ]
    out = w.execute(SchedulerOutput(0, new_reqs=reqs, num_scheduled_tokens={"m": 12, "free": 12}))
    got = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
    assert got == {"m": [top[1]], "free": [top[0]]}
    assert out.logprobs[0][0][1][0] == pytest.approx(ref.log_softmax(-1)[top[1]].item(), abs=1e-4)
    # Once the request has min_tokens outputs the stop token is allowed again.
    cached = CachedRequestData(["m"], [[top[1]]], [None], [12])
    out = w.execute(SchedulerOutput(1, cached_reqs=cached, num_scheduled_tokens={"m": 1}))
    with torch.no_grad():
        nxt = hf_llama(torch.tensor([PROMPT + [top[1]]])).logits[0, -1].argmax().item()
    assert out.sampled_token_ids == [[nxt]]


def test_collective_rpc_reaches_worker_methods_in_process(llama):
    from pagedserve.controller.executor import LocalExecutor

    ex = LocalExecutor(lambda: worker_for(llama, layout_blocks=16))
    ex.initialize()  # worker_for already loaded the model and allocated 16 blocks
    info = ex.collective_rpc("rank_info")
    assert info == [{"rank": 0, "tp": [0, 1], "dcp": [0, 1], "device": "cpu", "num_kv_blocks": 16}]
    ex.init_kv_cache(KVCacheLayout(24, B, [[0, 1]]))  # set-up calls take the same path
    assert ex.collective_rpc("rank_info")[0]["num_kv_blocks"] == 24
    ex.shutdown()
