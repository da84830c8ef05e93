"""Fuzzing every decoder of the wire: random bytes and mutated valid frames give a typed
decode error (``MessageDecodeError``) or one of our messages, never a crash, a hang or
another object where a message is expected."""

from __future__ import annotations

import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.frame_auth import FrameAuth, FrameAuthError
from pagedserve.messages import (
    AbortRequest,
    AddRequest,
    AddResult,
    CachedRequestData,
    CompletionDelta,
    EngineStatus,
    MessageDecodeError,
    ModelRunnerOutput,
    NewRequestData,
    OutputBatch,
    RequestDelta,
    SamplingParams,
    SchedulerOutput,
    StatusRequest,
    decode,
    decode_message,
    encode,
)

VALID = [
    AddRequest("r1", [1, 2, 3], SamplingParams(max_tokens=3, stop=["x"], seed=3), "hi", "s"),
    AbortRequest("r1"),
    StatusRequest(7),
    EngineStatus(True, {"num_running": 2, "kv_usage": 0.5}, None, 7),
    OutputBatch([AddResult("r2", "PromptTooLongError", "too long")],
                [RequestDelta("r1", [CompletionDelta(0, [5], "a", [{5: -0.5}], "stop")], True)]),
    SchedulerOutput(
        3, [NewRequestData("a", [1, 2], [], SamplingParams(), [[1, 2]], 0)],
        CachedRequestData(["b"], [[4]], [None], [7]), {"a": 2, "b": 1}, 3, ["c"], [[1, 2]],
    ),
    ModelRunnerOutput(3, ["a", "b"], [[9], [5, 6, 7]], [[[[9, 4], [-0.1, -2.0]]], None]),
]
MESSAGE_TYPES = tuple({type(m) for m in VALID})
RUNS = {"random": 0, "mutated": 0, "auth": 0}


def _mutate(data: bytes, draw_ops: list[tuple[int, int, int]]) -> bytes:
    buf = bytearray(data)
    for kind, pos, val in draw_ops:
        if not buf:
            buf.append(val)
            continue
        i = pos % len(buf)
        if kind == 0:
            buf[i] = val  # flip a byte
        elif kind == 1:
            del buf[i:]  # truncate
        elif kind == 2:
            buf.insert(i, val)  # insert
        else:
            buf[i:i] = buf[i : i + 8]  # duplicate a run
    return bytes(buf)


def _check(data: bytes) -> None:
    start = time.monotonic()
    try:
        msg = decode_message(data, MESSAGE_TYPES)
    except MessageDecodeError:
        pass
    else:
        assert isinstance(msg, MESSAGE_TYPES)
    assert time.monotonic() - start < 1.0  # no pathological input stalls a decoder


FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(data: bytes) -> None:
    RUNS["random"] += 1
    _check(data)


@FUZZ
@given(st.sampled_from(VALID),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10_000), st.integers(0, 255)),
                min_size=1, max_size=6))
def test_mutated_valid_frames(msg, ops) -> None:
    RUNS["mutated"] += 1
    _check(_mutate(encode(msg), ops))


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_frame_authentication_rejects_what_it_did_not_seal(parts) -> None:
    RUNS["auth"] += 1
    auth = FrameAuth(b"k" * 32)
    try:
        auth.open(parts)
    except FrameAuthError:
        pass
    else:
        raise AssertionError("an unsealed frame was accepted")
    assert auth.open(auth.seal(parts)) == parts


def test_valid_frames_decode_and_plain_data_is_not_a_message() -> None:
    for msg in VALID:
        assert decode_message(encode(msg), MESSAGE_TYPES) == msg
    for plain in (1, "x", [1, 2], {"a": 1}, None):
        try:
            decode_message(encode(plain), MESSAGE_TYPES)
        except MessageDecodeError:
            continue
        raise AssertionError(f"{plain!r} decoded as a message")
    # A message of the wrong kind for this socket is refused too.
    try:
        decode_message(encode(AbortRequest("a")), (ModelRunnerOutput,))
    except MessageDecodeError:
        pass
    else:
        raise AssertionError("an AbortRequest passed as a ModelRunnerOutput")
    assert decode(encode(StatusRequest(1))) == StatusRequest(1)


def test_deeply_nested_frames_are_refused() -> None:
    deep = b"\x91" * 100_000 + b"\xc0"  # a list in a list in ... 100k deep
    _check(deep)
