"""End to end on a real worker: a value that got past every check at admission fails its own
request with a typed error and costs nobody else anything.

Each case injects a value the checks would refuse, by going around them (a frozen
``SamplingParams`` written after validation; a controller told the vocabulary is larger than
it is). Without the worker's per-request admission each one fails the whole step: the worker
group is rebuilt, every request in flight waits for it, the bad one fails the new group again
until its failure limit, and the restart budget shrinks.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.controller.errors import RequestFailedError
from pagedserve.controller.outputs import final_output_sink
from pagedserve.messages import AddRequest, RequestOutput

GOOD = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 99, 3, 42, 7, 250, 11, 64, 8, 33, 120, 9, 14, 77, 2, 19]


@pytest.fixture(scope="module")
def llm(checkpoint_dir) -> Iterator[LLM]:
    engine = LLM(str(checkpoint_dir("llama")), backend="local",
                 kv_cache_memory_bytes=1 << 22, max_model_len=128)
    try:
        yield engine
    finally:
        engine.shutdown()


def _past_the_checks(params: SamplingParams, **values: Any) -> SamplingParams:
    for name, value in values.items():
        object.__setattr__(params, name, value)  # after validation: as if a check missed it
    return params


def _run(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    """Submit every request before waiting on any (so they share steps); the final outputs."""
    done: dict[str, RequestOutput] = {}
    finished = threading.Event()

    def record(out: RequestOutput) -> None:
        done[out.request_id] = out
        if len(done) == len(requests):
            finished.set()

    futs = []
    for rid, (prompt, params) in requests.items():
        req = AddRequest(rid, prompt, params)
        futs.append(llm.client.submit(req, final_output_sink(req, record)))
    for fut in futs:
        llm.client.wait_added(fut)
    assert finished.wait(60), f"only {sorted(done)} finished"
    return done


def _injected(llm: LLM, kind: str) -> tuple[list[int], SamplingParams]:
    if kind == "top_k":  # the int64 column of the sampling rows cannot hold it
        return [*PROMPT], _past_the_checks(SamplingParams(max_tokens=4), top_k=2**63)
    if kind == "seed":  # past the 64 bits its noise seeds are made of
        return [*PROMPT], _past_the_checks(SamplingParams(max_tokens=4), seed=2**64)
    # A prompt token past the vocabulary: it would index the embedding out of bounds.
    return [*PROMPT[:5], llm.engine.vocab_size + 5], SamplingParams(max_tokens=4)


@pytest.mark.parametrize("kind", ["top_k", "seed", "token_id"])
def test_a_value_past_the_checks_fails_its_request_alone(llm: LLM, kind: str, monkeypatch) -> None:
    engine = llm.engine
    alone = _run(llm, {"alone": ([*PROMPT], GOOD)})["alone"].outputs[0].token_ids
    restarts, failures = engine.num_restarts, engine.restarts.recent_failures
    bad = _injected(llm, kind)
    if kind == "token_id":  # the controller's vocabulary check lets it through
        monkeypatch.setattr(engine, "vocab_size", engine.vocab_size + 100)
    outs = _run(llm, {"before": ([*PROMPT], GOOD), "bad": bad, "after": ([*PROMPT, 1], GOOD)})
    monkeypatch.undo()

    failed = outs["bad"]
    assert failed.error_code == RequestFailedError.__name__ and failed.finished
    assert [c.finish_reason for c in failed.outputs] == ["error"]
    assert outs["before"].error is None and outs["before"].outputs[0].token_ids == alone
    assert outs["after"].error is None and len(outs["after"].outputs[0].token_ids) == 8
    assert engine.num_restarts == restarts and engine.restarts.recent_failures == failures
    assert llm.client.is_healthy()
    # It serves on, the same as before.
    again = _run(llm, {"again": ([*PROMPT], GOOD)})["again"]
    assert again.outputs[0].token_ids == alone
    engine.check_idle_kv()
    assert engine.stats()["kv_integrity_ok"] == 1


def test_generate_raises_the_typed_error_and_the_engine_serves_on(llm: LLM) -> None:
    with pytest.raises(RequestFailedError, match="OverflowError"):
        llm.generate([[*PROMPT]], _injected(llm, "top_k")[1], use_tqdm=False)
    out = llm.generate([[*PROMPT]], GOOD, use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 8
    assert llm.engine.num_restarts == 0
