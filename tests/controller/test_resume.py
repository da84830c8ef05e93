"""A request moved to a new engine with what its client received (``controller.resume``) goes
on as if nothing had happened: the client's stream, joined across the two engines, equals an
uninterrupted run's (tokens, text held back for stop strings, ``n > 1``, seeds), with nothing
sent twice; a resume state that cannot be the request's is refused with nothing queued."""

from __future__ import annotations

import dataclasses

import pytest

from pagedserve.controller.errors import InvalidGrammarError, InvalidTokenError, RequestError
from pagedserve.controller.outputs import OutputAccumulator
from pagedserve.controller.resume import ResumeTracker
from pagedserve.controller.structured_output import GrammarGate
from pagedserve.messages import (
    AddRequest,
    CompletionDelta,
    RequestDelta,
    ResumeState,
    SamplingParams,
    StructuredOutputsParams,
    decode_message,
    encode,
)

SHARED = [5, 6, 7, 8, 9, 10, 11, 12]
WORKLOAD = [
    AddRequest("greedy", SHARED + [1, 2, 3], SamplingParams(max_tokens=14, ignore_eos=True)),
    AddRequest("seeded", SHARED + [4], SamplingParams(max_tokens=9, seed=7, temperature=1.0,
                                                      top_p=0.9, ignore_eos=True)),
    AddRequest("pair", [20, 21, 22, 23, 24, 25], SamplingParams(n=2, seed=3, max_tokens=8,
                                                                ignore_eos=True)),
    AddRequest("short", [30, 31], SamplingParams(max_tokens=2, ignore_eos=True)),
    AddRequest("long-pair", list(range(40, 70)), SamplingParams(n=3, seed=1, max_tokens=5,
                                                                ignore_eos=True)),
]


def run_moved(kit, requests, cut: int | None, make_executor=None, **engine):
    """Run ``requests`` on one engine; after ``cut`` steps (None: never) drop it and resubmit
    the unfinished ones to a new engine with what their client received. The client's view:
    each request's output joined from every delta it got, and the deltas themselves."""
    make_executor = make_executor or kit.FakeExecutor
    accs = {r.request_id: OutputAccumulator(r.request_id, None, r.prompt_token_ids, r.params.n)
            for r in requests}
    trackers = {r.request_id: ResumeTracker(r.params.n) for r in requests}
    seen: dict[str, list[RequestDelta]] = {r.request_id: [] for r in requests}

    def feed(deltas):
        for d in deltas:
            trackers[d.request_id].add(d)
            accs[d.request_id].add(d)
            seen[d.request_id].append(d)

    eng = kit.make_engine(executor=make_executor(), **engine)
    for r in requests:
        eng.core.add_request(r)
    steps = 0
    while eng.has_unfinished() and (cut is None or steps < cut):
        feed(eng.core.step())
        steps += 1
    if eng.has_unfinished():
        eng = kit.make_engine(executor=make_executor(), **engine)
        for r in requests:
            if not accs[r.request_id].output.finished:
                eng.core.add_request(dataclasses.replace(
                    r, resume=trackers[r.request_id].state()))
        for _ in range(1000):
            if not eng.has_unfinished():
                break
            feed(eng.core.step())
            eng.kv.check_integrity()
    kit.assert_idle(eng)
    return {rid: acc.output for rid, acc in accs.items()}, seen


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 8, 12])
def test_a_moved_workload_equals_an_uninterrupted_one(kit, cut) -> None:
    engine = {"num_gpu_blocks": 40, "max_num_batched_tokens": 16, "max_num_seqs": 8}
    ref, _ = run_moved(kit, WORKLOAD, None, **engine)
    got, deltas = run_moved(kit, WORKLOAD, cut, **engine)
    assert got == ref
    for rid, ds in deltas.items():
        assert not [d for d in ds if d.error is not None]
        assert sum(d.finished for d in ds) == 1, rid  # one final delta, never a second one
        for c in got[rid].outputs:
            assert c.finish_reason == "length"


@pytest.mark.parametrize("cut", range(1, 12))
def test_text_held_back_for_a_stop_string_is_sent_once(kit, byte_tokenizer, cut) -> None:
    tok = byte_tokenizer
    script = tok.encode("héllo wörld, the STOP end") + tok.encode(" tail" * 5)
    request = AddRequest("r", [11, 12, 13], SamplingParams(max_tokens=60, stop=["STOP", "wörld!"]))

    def make():
        return kit.FakeExecutor(vocab_size=len(tok.hf), script={"r": script})

    ref, _ = run_moved(kit, [request], None, make, tokenizer=tok)
    got, deltas = run_moved(kit, [request], cut, make, tokenizer=tok)
    assert got == ref
    assert got["r"].outputs[0].text == "héllo wörld, the "
    assert got["r"].outputs[0].stop_reason == "STOP"


def test_finished_completions_stay_finished_and_prompt_logprobs_are_not_resent(kit) -> None:
    eng = kit.make_engine()
    params = SamplingParams(n=3, seed=2, max_tokens=6, ignore_eos=True, prompt_logprobs=1,
                            logprobs=1)
    prompt = list(range(100, 110))
    state = ResumeState([[1, 2], [3, 4, 5, 6, 7, 8], []], [0, 0, 0], [-1.5, -2.0, None],
                        [False, True, False], num_prompt_logprobs=len(prompt))
    eng.core.add_request(AddRequest("r", prompt, params, resume=state))
    seqs = {r.request_id: r for r in eng.scheduler.requests.values()}
    assert set(seqs) == {"r", "r#0", "r#2"}  # the fork parent and the unfinished children
    assert seqs["r#0"].output_token_ids == [1, 2] and not seqs["r#0"].needs_prompt_logprobs
    out = kit.run(eng)["r"]
    kit.assert_idle(eng)
    assert out.prompt_logprobs is None  # every position was received before the move
    assert [len(c.token_ids) for c in out.outputs] == [4, 0, 6]
    assert out.outputs[1].finish_reason is None  # no delta for the finished one
    assert out.outputs[0].cumulative_logprob == -1.5  # carried on from the client's


@pytest.mark.parametrize(("state", "error"), [
    (ResumeState([[1], [2]], [0, 0], [None, None], [False, False]), RequestError),  # n is 1
    (ResumeState([[1, 5000]], [0], [None], [False]), InvalidTokenError),
    (ResumeState([[1, 2, 3, 4]], [0], [None], [False]), RequestError),  # max_tokens reached
    (ResumeState([[1]], [0], [None], [True]), RequestError),  # nothing left to run
    (ResumeState([[1]], [0], [None], [False], num_prompt_logprobs=9), RequestError),
])
def test_a_state_that_cannot_be_the_requests_is_refused(kit, state, error) -> None:
    eng = kit.make_engine()
    params = SamplingParams(max_tokens=4, prompt_logprobs=0)
    with pytest.raises(error):
        eng.core.add_request(AddRequest("r", [1, 2, 3], params, resume=state))
    assert not eng.has_unfinished() and not eng.scheduler.requests
    eng.core.add_request(AddRequest("r", [1, 2, 3], params))  # the id is free
    assert kit.run(eng)["r"].outputs[0].finish_reason == "length"


def test_a_resumed_add_crosses_the_wire() -> None:
    state = ResumeState([[1, 2], []], [3, 0], [-0.5, None], [False, True], 4)
    add = AddRequest("r", [7, 8], SamplingParams(n=2), resume=state)
    assert decode_message(encode(add), (AddRequest,)) == add


def test_the_tracker_folds_what_the_client_received() -> None:
    t = ResumeTracker(2)
    assert t.state() is None  # nothing received: resubmitted as it was
    t.add(RequestDelta("r", [CompletionDelta(0, [4, 5], "ab", cumulative_logprob=-1.0)],
                       prompt_logprobs=[None, {1: -0.5}]))
    t.add(RequestDelta("r", [CompletionDelta(1, [6], "c", finish_reason="stop"),
                             CompletionDelta(0, [7], "", cumulative_logprob=-2.0)]))
    # An error delta names every completion; the finished one keeps what it had.
    t.add(RequestDelta("r", [CompletionDelta(1, [], "", finish_reason="error")]))
    assert t.state() == ResumeState([[4, 5, 7], [6]], [2, 1], [-2.0, None], [False, True], 2)
    assert t.unfinished() == [0]


def test_a_grammar_catches_up_with_the_resumed_tokens(kit, byte_tokenizer) -> None:
    tok = byte_tokenizer
    eng = kit.make_engine(executor=kit.FakeExecutor(vocab_size=len(tok.hf)), tokenizer=tok)
    choice = StructuredOutputsParams(choice=["hello world", "the end"])
    ids = tok.encode("hello")
    params = SamplingParams(max_tokens=20, structured_outputs=choice)
    eng.core.add_request(AddRequest("r", [1, 2], params,
                                    resume=ResumeState([ids], [5], [None], [False])))
    gate: GrammarGate = eng.core._grammars
    ((head, error),) = gate.release(30.0)
    assert error is None
    # The matcher took "hello": only the rest of "hello world" is allowed now.
    allowed = head.grammar.masks([])
    words = [int.from_bytes(allowed[i:i + 4], "little") for i in range(0, len(allowed), 4)]
    tokens = [t for t in range(len(tok.hf)) if words[t // 32] >> (t % 32) & 1]
    assert tokens and all(tok.decode([t]) and " world".startswith(tok.decode([t]))
                          for t in tokens if t != tok.hf.eos_token_id)
    eng.core.add_request(AddRequest("bad", [1, 2], params, resume=ResumeState(
        [tok.encode("the x")], [0], [None], [False])))
    ((_, error),) = gate.release(30.0)
    assert isinstance(error, InvalidGrammarError)
