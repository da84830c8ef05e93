from __future__ import annotations

import msgpack
import pytest

from pagedserve.messages import (
    CachedRequestData,
    MessageDecodeError,
    ModelRunnerOutput,
    NewRequestData,
    RequestDelta,
    SamplingParams,
    SamplingParamsError,
    SchedulerOutput,
    decode,
    encode,
)


def _decode_step(n: int) -> SchedulerOutput:
    ids = [f"req-{i}" for i in range(n)]
    return SchedulerOutput(
        step_id=12345,
        cached_reqs=CachedRequestData(
            req_ids=ids,
            new_token_ids=[[1000 + i] for i in range(n)],
            new_block_ids=[[[4000 + i]] if i % 16 == 0 else None for i in range(n)],
            num_computed_tokens=[300 + i for i in range(n)],
        ),
        num_scheduled_tokens={r: 1 for r in ids},
        total_num_scheduled_tokens=n,
    )


def test_round_trip_every_field() -> None:
    sp = SamplingParams(
        n=2, temperature=0.7, top_k=5, stop=["\n\n"], seed=7, logprobs=3, prompt_logprobs=2
    )
    out = SchedulerOutput(
        step_id=3,
        new_reqs=[NewRequestData("a", [1, 2, 3], [], sp, [[5, 6], [7]], 0)],
        cached_reqs=CachedRequestData(["b"], [[9]], [None], [17]),
        num_scheduled_tokens={"a": 3, "b": 1},
        total_num_scheduled_tokens=4,
        finished_req_ids=["c"],
        block_copies=[(3, 4)],
    )
    back = decode(encode(out))
    assert back.new_reqs[0].sampling_params == sp
    assert back.new_reqs[0].block_ids == [[5, 6], [7]]
    assert back.cached_reqs == out.cached_reqs
    assert back.num_scheduled_tokens == out.num_scheduled_tokens
    assert [tuple(c) for c in back.block_copies] == [(3, 4)]
    mro = ModelRunnerOutput(3, ["a"], [[42]], [[([42, 7], [-0.1, -2.5])]])
    back_mro = decode(encode(mro))
    assert back_mro.req_ids == ["a"] and back_mro.sampled_token_ids == [[42]]
    assert [list(x) for x in back_mro.logprobs[0][0]] == [[42, 7], [-0.1, -2.5]]
    mro.prompt_logprobs = {"a": (1, [[2, 9], [3, 9]], [[-1.5, -0.5], [-2.0, -0.5]])}
    first, ids, lps = decode(encode(mro)).prompt_logprobs["a"]
    assert (first, ids, lps) == (1, [[2, 9], [3, 9]], [[-1.5, -0.5], [-2.0, -0.5]])
    delta = RequestDelta("r", [], prompt_logprobs=[None, {2: -1.5, 9: -0.5}])
    assert decode(encode(delta)).prompt_logprobs == [None, {2: -1.5, 9: -0.5}]


def test_accepted_token_lists_and_drafts_round_trip() -> None:
    # A step that verified drafts: per request 1 to k + 1 accepted tokens, a logprob entry per
    # accepted token, and the drafts it verified in the scheduler's message.
    out = SchedulerOutput(
        step_id=4,
        cached_reqs=CachedRequestData(["a", "b"], [[1], [2]], [None, None], [10, 20]),
        num_scheduled_tokens={"a": 4, "b": 1},
        total_num_scheduled_tokens=5,
        draft_token_ids={"a": [7, 8, 9]},
    )
    back = decode(encode(out))
    assert back.draft_token_ids == {"a": [7, 8, 9]}
    assert decode(encode(SchedulerOutput(5))).draft_token_ids == {}
    lps = [([7, 3], [-0.2, -1.9]), ([8, 8], [-0.1, -0.1]), ([4, 4], [-0.3, -0.3])]
    mro = ModelRunnerOutput(4, ["a", "b"], [[7, 8, 4], [5]], [lps, None])
    back_mro = decode(encode(mro))
    assert back_mro.sampled_token_ids == [[7, 8, 4], [5]]
    assert back_mro.logprobs[1] is None
    assert [[list(x) for x in entry] for entry in back_mro.logprobs[0]] == [
        [list(i), list(v)] for i, v in lps
    ]


def test_decode_step_of_256_requests_is_small() -> None:
    frame = encode(_decode_step(256))
    # About 30 bytes a request: an id, a token, a count, a scheduled-token entry.
    assert len(frame) < 256 * 40, len(frame)
    assert decode(frame).cached_reqs.req_ids[-1] == "req-255"


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",  # never used in msgpack
        msgpack.packb(msgpack.ExtType(99, msgpack.packb([1]))),  # unknown tag
        msgpack.packb(msgpack.ExtType(1, msgpack.packb([1, 2]))),  # wrong field count
        msgpack.packb(msgpack.ExtType(1, b"\x00garbage")),
    ],
)
def test_malformed_frames_are_rejected(frame: bytes) -> None:
    with pytest.raises(MessageDecodeError):
        decode(frame)


def test_invalid_values_inside_a_frame_are_rejected() -> None:
    good = encode(SamplingParams())
    fields = msgpack.unpackb(msgpack.unpackb(good).data)
    fields[3] = -1.0  # temperature
    bad = msgpack.packb(msgpack.ExtType(1, msgpack.packb(fields)))
    with pytest.raises(MessageDecodeError, match="temperature"):
        decode(bad)


def test_unregistered_objects_are_not_encoded() -> None:
    class Foo:
        pass

    with pytest.raises(TypeError):
        encode(Foo())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": [(5, 1.0), (5, 2.0)]}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -1]}, "allowed_token_ids"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ],
)
def test_sampling_params_name_the_bad_field(kwargs: dict, field: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


def test_token_choices_are_frozen_and_cross_the_wire() -> None:
    p = SamplingParams(logit_bias={9: -2.0, 3: 1.5}, allowed_token_ids=[4, 3, 9],
                       include_stop_str_in_output=True)
    assert p.logit_bias == ((3, 1.5), (9, -2.0)) and p.allowed_token_ids == (4, 3, 9)
    assert decode(encode(p)) == p


def test_sampling_params_error_survives_pickling() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(SamplingParamsError("top_p", "must be in (0, 1]")))
    assert err.field == "top_p" and "top_p" in str(err)
