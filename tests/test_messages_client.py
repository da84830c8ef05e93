"""Client <-> controller messages, and the ZeroMQ serving path without Ray.

A ``ReplicaServer`` over an ``EngineCore`` with a tiny fake executor, and ``RemoteEngineClient``
talking to it over TCP on loopback: typed refusals, cumulative outputs rebuilt from deltas,
abort, duplicate ids across clients, and death.
"""

from __future__ import annotations

import queue
import time

import pytest
from helpers.sinks import add

from pagedserve.cluster.ray_controller import ReplicaServer
from pagedserve.cluster.remote_client import RemoteEngineClient
from pagedserve.config import from_flat
from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.errors import (
    EmptyPromptError,
    EngineDeadError,
    InvalidTokenError,
    PromptTooLongError,
    RequestError,
    error_code,
    error_from_code,
)
from pagedserve.controller.loop import EngineLoop
from pagedserve.controller.outputs import OutputAccumulator
from pagedserve.frame_auth import FrameAuth
from pagedserve.messages import (
    AbortRequest,
    AddRequest,
    AddResult,
    CompletionDelta,
    EngineStatus,
    KVCacheLayout,
    LayerKVSpec,
    ModelRunnerOutput,
    OutputBatch,
    RequestDelta,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
    StatusRequest,
    WorkerReport,
    decode,
    encode,
)

VOCAB = 100


def test_round_trip() -> None:
    sp = SamplingParams(max_tokens=3, temperature=0.0, stop=["x"], seed=3)
    msgs = [
        AddRequest("r1", [1, 2, 3], sp, "hi", "salt"),
        AddRequest("r2", [4], SamplingParams()),
        AbortRequest("r1"),
        AddResult("r1"),
        AddResult("r2", "PromptTooLongError", "too long"),
        OutputBatch(
            [AddResult("r2", "PromptTooLongError", "too long")],
            [RequestDelta("r1", [CompletionDelta(0, [5, 6], "ab", [{5: -0.5, 7: -1.0}], "stop",
                                                 "x", -0.5)], True, 16, None)],
        ),
        StatusRequest(7),
        EngineStatus(True, {"num_running_reqs": 2, "kv_usage": 0.5}, None, 7),
        EngineStatus(False, {}, "worker died", -1),
    ]
    for m in msgs:
        assert decode(encode(m)) == m


def test_error_types_map_back() -> None:
    assert isinstance(error_from_code("PromptTooLongError", "m"), PromptTooLongError)
    assert isinstance(error_from_code("EngineDeadError", "m"), EngineDeadError)
    err = error_from_code("SomethingNewError", "m")
    assert type(err) is RequestError
    assert error_code(PromptTooLongError("x")) == "PromptTooLongError"
    assert error_code(ValueError("x")) == "RequestError"


def test_deltas_rebuild_cumulative_outputs() -> None:
    acc = OutputAccumulator("k", "p", [1, 2], 1)
    pieces = [("he", [0]), ("llo", [1]), (" wor", [2])]
    for i, (text, toks) in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = RequestDelta("k", [CompletionDelta(0, toks, text, None, "stop" if last else None)],
                             finished=last)
        out = acc.add(decode(encode(OutputBatch([], [delta]))).outputs[0])
    assert out.outputs[0].text == "hello wor" and out.outputs[0].token_ids == [0, 1, 2]
    assert out.prompt_token_ids == [1, 2] and out.prompt == "p" and out.finished


class TinyExecutor:
    """Emits ``(last * 7 + 1) % VOCAB`` for each request whose scheduled tokens end this step."""

    def __init__(self, fail_at_step: int | None = None, step_s: float = 0.0) -> None:
        self.rows: dict[str, list[int]] = {}
        self.seen: set[str] = set()
        self.fail_at_step = fail_at_step
        self.step_s = step_s

    def initialize(self) -> WorkerReport:
        return WorkerReport([LayerKVSpec(2, 8, 2)], 1 << 20, VOCAB, 64, "cpu")

    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        pass

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.fail_at_step is not None and so.step_id >= self.fail_at_step:
            raise RuntimeError("boom")
        time.sleep(self.step_s)  # a step takes time, so an abort can land mid-request
        for rid in so.finished_req_ids:
            self.rows.pop(rid, None)
        done: dict[str, int] = {}
        for nr in so.new_reqs:
            self.seen.add(nr.req_id)
            self.rows[nr.req_id] = [*nr.prompt_token_ids, *nr.output_token_ids, 0]
            self.rows[nr.req_id][-1] = nr.num_computed_tokens
        c = so.cached_reqs
        for i, rid in enumerate(c.req_ids):
            row = self.rows[rid]
            row[-1:-1] = c.new_token_ids[i]
            row[-1] = c.num_computed_tokens[i]
        out = ModelRunnerOutput(so.step_id)
        for rid, n in so.num_scheduled_tokens.items():
            row = self.rows[rid]
            row[-1] += n
            if row[-1] == len(row) - 1:
                done[rid] = (row[-2] * 7 + 1) % VOCAB
        out.req_ids = list(done)
        out.sampled_token_ids = [[t] for t in done.values()]
        return out

    def check_failure(self) -> None:
        return None

    def restart(self) -> WorkerReport:
        return self.initialize()

    def shutdown(self) -> None:
        pass


def expected(prompt: list[int], n: int) -> list[int]:
    toks, last = [], prompt[-1]
    for _ in range(n):
        last = (last * 7 + 1) % VOCAB
        toks.append(last)
    return toks


@pytest.fixture
def served():
    cfg = from_flat(block_size=4, num_gpu_blocks=64, max_model_len=64, max_num_batched_tokens=64)
    core = EngineCore(cfg, TinyExecutor(step_s=0.01), tokenizer=None, eos_token_ids=())
    server = ReplicaServer(EngineLoop(core), "tiny")
    info = {"model_name": "tiny", "max_model_len": 64, "vocab_size": VOCAB, "block_size": 4,
            "auth_key": server.auth.key}
    clients: list[RemoteEngineClient] = []

    def connect(**kw) -> RemoteEngineClient:
        client = RemoteEngineClient(server.endpoint, info, **kw)
        clients.append(client)
        return client

    yield server, connect
    for c in clients:
        c.shutdown()
    server.shutdown()


def _collect(q: queue.SimpleQueue, n: int, timeout: float = 10.0) -> dict[str, RequestOutput]:
    got: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + timeout
    while len(got) < n:
        out = q.get(timeout=max(0.01, deadline - time.monotonic()))
        if out.finished:
            got[out.request_id] = out
    return got


def test_generate_refuse_abort_over_zmq(served) -> None:
    server, connect = served
    client = connect()
    q: queue.SimpleQueue = queue.SimpleQueue()
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    add(client, "a", [1, 2, 3], greedy, q.put)
    with pytest.raises(PromptTooLongError):
        add(client, "long", list(range(1, 80)), greedy, q.put)
    with pytest.raises(InvalidTokenError):
        add(client, "bad", [1, VOCAB + 5], greedy, q.put)
    with pytest.raises(EmptyPromptError):
        add(client, "empty", [], greedy, q.put)
    add(client, "b", [4, 5], greedy, q.put)
    slow = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    add(client, "c", [9], slow, q.put)
    client.abort_request("c")
    got = _collect(q, 3)
    assert got["a"].outputs[0].token_ids == expected([1, 2, 3], 5)
    assert got["a"].prompt_token_ids == [1, 2, 3]
    assert got["b"].outputs[0].token_ids == expected([4, 5], 5)
    assert got["c"].outputs[0].finish_reason == "abort"
    stats = client.stats()
    assert stats["kv_blocks_used"] == 0 and client.is_healthy()

    # n > 1: every completion comes back, rebuilt from its deltas.
    add(client, "pair", [3, 4], SamplingParams(n=2, max_tokens=4, ignore_eos=True), q.put)
    pair = _collect(q, 1)["pair"]
    assert [c.index for c in pair.outputs] == [0, 1]
    assert all(c.token_ids == expected([3, 4], 4) for c in pair.outputs)

    # A second client may reuse the same request ids.
    other = connect()
    q2: queue.SimpleQueue = queue.SimpleQueue()
    add(other, "a", [7], greedy, q2.put)
    assert _collect(q2, 1)["a"].outputs[0].token_ids == expected([7], 5)


def test_engine_death_reaches_client() -> None:
    cfg = from_flat(block_size=4, num_gpu_blocks=64, max_model_len=64)
    core = EngineCore(cfg, TinyExecutor(fail_at_step=3), tokenizer=None, eos_token_ids=())
    server = ReplicaServer(EngineLoop(core), "tiny")
    client = RemoteEngineClient(server.endpoint, {"model_name": "t", "max_model_len": 64,
                                                  "vocab_size": VOCAB, "block_size": 4,
                                                  "auth_key": server.auth.key})
    try:
        q: queue.SimpleQueue = queue.SimpleQueue()
        add(client, "a", [1], SamplingParams(max_tokens=20, ignore_eos=True), q.put)
        out = _collect(q, 1)["a"]
        assert out.error is not None and "boom" in out.error
        deadline = time.monotonic() + 5
        while client.is_healthy() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not client.is_healthy()
        with pytest.raises(EngineDeadError):
            add(client, "b", [1], SamplingParams(), q.put)
    finally:
        client.shutdown()
        server.shutdown()


def test_a_strangers_well_formed_commands_change_nothing(served) -> None:
    """A DEALER that reaches the controller's port without the engine's key cannot add, abort
    or even ask for status; the engine's own client still can."""
    import zmq

    server, connect = served
    client = connect()
    q: queue.SimpleQueue = queue.SimpleQueue()
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    add(client, "mine", [1, 2], long, q.put)
    ctx = zmq.Context()
    try:
        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(server.endpoint)
        forged = FrameAuth.new()
        for msg in (AddRequest("evil", [3, 4], SamplingParams(max_tokens=30)),
                    AbortRequest("mine"), StatusRequest(1)):
            stranger.send_multipart([encode(msg)])
            stranger.send_multipart(forged.seal([encode(msg)]))
        assert not stranger.poll(500)  # no answer of any kind
        got = _collect(q, 1)
        assert got["mine"].outputs[0].finish_reason == "length"  # not aborted
        assert len(got["mine"].outputs[0].token_ids) == 40
        stats = client.stats()
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        seen = server.engine.executor.seen
        assert any(r.endswith(":mine") for r in seen) and not any("evil" in r for r in seen)
    finally:
        ctx.destroy(linger=0)
