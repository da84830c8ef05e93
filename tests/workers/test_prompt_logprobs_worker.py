"""The worker's prompt logprobs: chunk by chunk in ``ModelRunnerOutput.prompt_logprobs``, only
for requests that asked, equal to transformers' float32 log-softmax; none again for a request
resumed after its prompt was done."""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.messages import KVCacheLayout, SamplingParams
from pagedserve.workers.worker import Worker

B = 4
PROMPT = [1, 17, 99, 4, 250, 31, 77, 8, 300, 41, 42, 5, 6, 9, 400, 3, 2]


@pytest.fixture(scope="module")
def llama(checkpoint_dir):
    return checkpoint_dir("llama")


@pytest.fixture(scope="module")
def reference(llama, checkpoints):
    model = checkpoints.load_hf_model(llama)

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)

    return logprobs


def _worker(path) -> Worker:
    w = Worker(
        EngineConfig(
            model=ModelConfig(model=str(path), dtype="float32"),
            cache=CacheConfig(block_size=B, kv_cache_memory_bytes=1 << 24),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        )
    )
    report = w.load_model()
    w.init_kv_cache(KVCacheLayout(64, B, [list(range(len(report.layer_specs)))]))
    return w


def _collect(outputs, rid: str) -> list[tuple[int, list[int], list[float]]]:
    """(position, ids, logprobs) of every prompt position reported for ``rid``, in order."""
    rows = []
    for out in outputs:
        if out.prompt_logprobs and rid in out.prompt_logprobs:
            first, ids, lps = out.prompt_logprobs[rid]
            rows.extend((first + i, a, b) for i, (a, b) in enumerate(zip(ids, lps, strict=True)))
    return rows


def test_chunked_prompt_logprobs_match_transformers(llama, reference, stepper_module):
    w = _worker(llama)
    st = stepper_module.Stepper(w, KVCacheLayout(64, B, [[0, 1]]), seed=2)
    st.add("lp", PROMPT, 2, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))
    st.add("plain", PROMPT[:6], 2)
    st.add("one", [7], 2, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=4))
    st.run(budget=5)  # 17 prompt tokens over several steps
    steps_with = [o for o in st.outputs if o.prompt_logprobs and "lp" in o.prompt_logprobs]
    assert len(steps_with) >= 3
    assert all(set(o.prompt_logprobs or {}) <= {"lp"} for o in st.outputs)
    rows = _collect(st.outputs, "lp")
    assert [p for p, *_ in rows] == list(range(1, len(PROMPT)))
    ref = reference(PROMPT)
    for p, ids, lps in rows:
        top = ref[p - 1].topk(2)
        assert ids == [PROMPT[p], *top.indices.tolist()]
        assert lps == pytest.approx(ref[p - 1, ids].tolist(), abs=1e-4)


def test_resumed_request_does_not_score_again(llama, stepper_module):
    w = _worker(llama)
    st = stepper_module.Stepper(w, KVCacheLayout(64, B, [[0, 1]]), seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=0)
    st.add("a", PROMPT, 6, sp)
    for _ in range(3):
        st.step(budget=8)
    before = len(st.outputs)
    assert len(_collect(st.outputs, "a")) == len(PROMPT) - 1
    r = st.drop("a")
    assert r.output  # preempted after its prompt: the outputs are recomputed with it
    st.add("a", r.prompt, 6, sp, output=r.output)
    st.run(budget=8)
    assert _collect(st.outputs[before:], "a") == []
