"""The per-step control channel: cluster/wire.py against workers/wire.py, ranks as threads on
127.0.0.1 (no Ray)."""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from pagedserve.cluster.wire import StepChannel
from pagedserve.cluster.wire_frames import (
    BadFrameError,
    HandshakeError,
    HandshakeTimeoutError,
    RankDisconnectedError,
    StepTimeoutError,
    WireError,
    WorkerStepError,
)
from pagedserve.frame_auth import FrameAuth
from pagedserve.messages import (
    CachedRequestData,
    ModelRunnerOutput,
    SchedulerOutput,
    encode,
)
from pagedserve.workers.wire import (
    BadStepFrameError,
    ChannelStopped,
    ControllerUnreachableError,
    StepReceiver,
    StepReceiveTimeout,
)

pytestmark = pytest.mark.timeout(30)


def _decode_step(step_id: int, n: int = 256) -> SchedulerOutput:
    """A decode step: n running requests, one new token each, a new block for every 16th."""
    ids = [f"req-{i}" for i in range(n)]
    return SchedulerOutput(
        step_id=step_id,
        cached_reqs=CachedRequestData(
            req_ids=ids,
            new_token_ids=[[(step_id * 7 + i) % 32000] for i in range(n)],
            new_block_ids=[[[1000 + step_id * n + i]] if i % 16 == 0 else None for i in range(n)],
            num_computed_tokens=[100 + step_id + i for i in range(n)],
        ),
        num_scheduled_tokens={r: 1 for r in ids},
        total_num_scheduled_tokens=n,
    )


def _output_for(step: SchedulerOutput) -> ModelRunnerOutput:
    """One token per request, and 1 to 4 for every 8th (accepted drafts): variable counts."""
    ids = step.cached_reqs.req_ids
    return ModelRunnerOutput(
        step.step_id,
        list(ids),
        [
            [(step.step_id + i + j) % 32000 for j in range(1 + (i // 8) % 4 if i % 8 == 0 else 1)]
            for i in range(len(ids))
        ],
    )


class RankThread(threading.Thread):
    """A rank's receive loop: record every step, reply if output rank, report failures."""

    def __init__(
        self,
        endpoints: tuple[str, str],
        rank: int,
        output_rank: int = 0,
        node: str | None = None,
        fail_at: int | None = None,
        silent_from: int | None = None,
    ) -> None:
        super().__init__(daemon=True, name=f"rank-{rank}")
        self.endpoints = endpoints
        self.rank = rank
        self.output_rank = output_rank
        self.node = node or f"node-{rank}"
        self.fail_at = fail_at
        # From this step on the output rank stops replying, as if stuck in a collective.
        self.silent_from = silent_from
        self.received: list[SchedulerOutput] = []
        self.error: BaseException | None = None
        self.stopped_by_controller = False
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            with StepReceiver(
                self.endpoints, self.rank, self.rank == self.output_rank, node=self.node
            ) as rx:
                while not self.halt.is_set():
                    try:
                        step = rx.recv(timeout_s=0.2)
                    except StepReceiveTimeout:
                        continue
                    except ChannelStopped:
                        self.stopped_by_controller = True
                        return
                    self.received.append(step)
                    try:
                        if step.step_id == self.fail_at:
                            raise ValueError(f"boom on rank {self.rank}")
                        silent = self.silent_from is not None and step.step_id >= self.silent_from
                        if rx.is_output_rank and not silent:
                            rx.reply(_output_for(step))
                    except ValueError as exc:
                        rx.reply_error(exc)
        except BaseException as exc:  # surfaced by the test through .error
            self.error = exc


@pytest.fixture
def group() -> Iterator[Callable[..., tuple[StepChannel, list[RankThread]]]]:
    made: list[tuple[StepChannel, list[RankThread]]] = []

    def make(
        world: int, output_rank: int = 0, started: int | None = None, **per_rank: dict
    ) -> tuple[StepChannel, list[RankThread]]:
        chan = StepChannel(world, host="127.0.0.1", output_rank=output_rank)
        ranks = [
            RankThread(chan.endpoints, r, output_rank, **per_rank.get(f"rank{r}", {}))
            for r in range(world if started is None else started)
        ]
        for t in ranks:
            t.start()
        made.append((chan, ranks))
        return chan, ranks

    yield make
    for chan, ranks in made:
        for t in ranks:
            t.halt.set()
        for t in ranks:
            t.join(timeout=5)
        chan.close()


@pytest.mark.parametrize("world", [2, 4])
def test_256_request_decode_step_reaches_every_rank_and_the_reply_returns(group, world) -> None:
    chan, ranks = group(world, output_rank=world - 1)
    info = chan.wait_ready(timeout_s=5)
    assert sorted(info) == list(range(world))
    assert info[world - 1].is_output_rank and info[0].node == "node-0"
    assert chan.step_endpoint.startswith("tcp://127.0.0.1:")
    assert not chan.step_endpoint.endswith(":0")

    steps = [_decode_step(k) for k in range(20)]
    for step in steps[:10]:
        size = chan.broadcast(step)
        assert size < 256 * 40
        out = chan.recv_reply(timeout_s=5)
        assert out == _output_for(step)
        assert len(out.sampled_token_ids) == 256
    # Pipelined: several steps in flight, replies matched to broadcasts in order.
    for step in steps[10:]:
        chan.broadcast(step)
    assert chan.in_flight == list(range(10, 20))
    assert [chan.recv_reply(timeout_s=5).step_id for _ in range(10)] == list(range(10, 20))

    assert chan.stop_workers(timeout_s=5) == []
    for t in ranks:
        t.join(timeout=5)
        assert t.error is None, t.error
        assert t.stopped_by_controller
        assert t.received == steps


def test_reply_timeout_is_typed_names_the_step_and_is_quick(group) -> None:
    chan, _ = group(2, rank0={"silent_from": 0})
    chan.wait_ready(timeout_s=5)
    chan.broadcast(_decode_step(7))
    start = time.monotonic()
    with pytest.raises(StepTimeoutError) as err:
        chan.recv_reply(timeout_s=0.2)
    elapsed = time.monotonic() - start
    assert 0.2 <= elapsed < 1.0
    assert err.value.step_id == 7 and 0.2 <= err.value.waited_s < 1.0
    assert isinstance(err.value, TimeoutError) and "step 7" in str(err.value)
    assert chan.in_flight == [7]  # still due: the caller may keep waiting or tear down


def test_handshake_timeout_names_the_missing_rank(group) -> None:
    chan, _ = group(3, started=2)
    start = time.monotonic()
    with pytest.raises(HandshakeTimeoutError) as err:
        chan.wait_ready(timeout_s=0.5)
    assert time.monotonic() - start < 2.0
    assert err.value.missing == [2]
    with pytest.raises(WireError, match="wait_ready"):
        chan.broadcast(_decode_step(0))


def test_failure_on_a_non_output_rank_surfaces_with_its_rank_and_node(group) -> None:
    # Rank 2 fails at step 4; the output rank then waits on it (as in a collective) and never
    # replies, so only rank 2's failure frame can end the wait before the deadline.
    chan, _ = group(3, rank0={"silent_from": 4}, rank2={"fail_at": 4, "node": "node-b"})
    chan.wait_ready(timeout_s=5)
    for k in range(4):
        chan.broadcast(_decode_step(k))
        chan.recv_reply(timeout_s=5)
    chan.broadcast(_decode_step(4))
    start = time.monotonic()
    with pytest.raises(WorkerStepError) as err:
        chan.recv_reply(timeout_s=10)
    assert time.monotonic() - start < 5
    e = err.value
    assert (e.rank, e.node, e.step_id, e.exc_type) == (2, "node-b", 4, "ValueError")
    assert "boom on rank 2" in e.message and "rank 2 on node node-b" in str(e)
    assert "ValueError" in e.traceback
    back = pickle.loads(pickle.dumps(e))
    assert (back.rank, back.node, back.message, back.step_id) == (2, "node-b", e.message, 4)


def test_garbage_on_the_reply_socket_is_rejected_and_the_channel_survives(group) -> None:
    """Frames that pass authentication but break the protocol (a buggy rank's)."""
    chan, _ = group(1)
    chan.wait_ready(timeout_s=5)
    auth = FrameAuth(chan.endpoints[2])
    ctx = zmq.Context()
    intruder = ctx.socket(zmq.PUSH)
    intruder.setsockopt(zmq.LINGER, 0)
    intruder.setsockopt(zmq.SNDTIMEO, 2000)
    intruder.connect(chan.reply_endpoint)
    garbage = [
        [b"\xc1 not msgpack"],
        [b"out", b"\xc1"],
        [b"out", encode(_decode_step(0, n=1))],  # well-formed, wrong type
        [b"out", encode(ModelRunnerOutput(99))],  # well-formed, wrong step
        [b"fail", encode("not a failure")],
        [b"what", b""],
    ]
    for frames in garbage:
        intruder.send_multipart(auth.seal(frames))
    try:
        rejected, outputs = 0, []
        for k in range(2):
            chan.broadcast(_decode_step(k))
            while len(outputs) <= k:
                try:
                    outputs.append(chan.recv_reply(timeout_s=5))
                except BadFrameError:
                    rejected += 1
        while rejected < len(garbage):  # the rest may still be queued behind the outputs
            chan.broadcast(_decode_step(2 + rejected))
            try:
                chan.recv_reply(timeout_s=5)
            except BadFrameError:
                rejected += 1
        assert [o.step_id for o in outputs] == [0, 1]
        assert rejected == len(garbage)
    finally:
        ctx.destroy(linger=0)


def test_garbage_from_the_controller_is_rejected_by_the_rank() -> None:
    ctx = zmq.Context()
    router, pull = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
    router.bind("tcp://127.0.0.1:0")
    pull.bind("tcp://127.0.0.1:0")
    auth = FrameAuth.new()
    endpoints = (router.LAST_ENDPOINT.decode(), pull.LAST_ENDPOINT.decode(), auth.key)
    rx = StepReceiver(endpoints, rank=0, is_output_rank=True, node="n")
    try:
        assert router.poll(5000)
        route, kind, _, _tag = router.recv_multipart()
        assert kind == b"hello"
        for frames in ([b"step", b"\xc1"], [b"step", encode(ModelRunnerOutput(1))], [b"x"]):
            router.send_multipart([route, *auth.seal(frames)])
            with pytest.raises(BadStepFrameError):
                rx.recv(timeout_s=5)
        # A stranger's well-formed step (no key, or another key) is dropped unseen.
        router.send_multipart([route, b"step", encode(_decode_step(7))])
        router.send_multipart([route, *FrameAuth.new().seal([b"step", encode(_decode_step(8))])])
        router.send_multipart([route, *auth.seal([b"step", encode(_decode_step(3))])])
        assert rx.recv(timeout_s=5) == _decode_step(3)
        with pytest.raises(StepReceiveTimeout):
            rx.recv(timeout_s=0.05)
        with pytest.raises(ValueError, match="not the output rank"):
            StepReceiver(endpoints, rank=1, is_output_rank=False).reply(ModelRunnerOutput(3))
        router.send_multipart([route, *auth.seal([b"stop", b""])])
        with pytest.raises(ChannelStopped):
            rx.recv(timeout_s=5)
    finally:
        rx.close()
        ctx.destroy(linger=0)


def test_an_unreachable_controller_is_a_typed_error_not_a_hang() -> None:
    chan = StepChannel(1)
    endpoints = chan.endpoints
    chan.close()  # nothing listens there any more
    start = time.monotonic()
    with pytest.raises(ControllerUnreachableError, match="hello"):
        StepReceiver(endpoints, rank=0, is_output_rank=True, send_timeout_s=0.2)
    assert time.monotonic() - start < 2.0
    with pytest.raises(ValueError, match="node's address"):
        StepChannel(1, host="0.0.0.0")


def test_contradictory_hellos_are_refused(group) -> None:
    chan, _ = group(2, started=0)
    a = RankThread(chan.endpoints, 0, node="node-a")
    b = RankThread(chan.endpoints, 0, node="node-b")
    for t in (a, b):
        t.start()
    try:
        with pytest.raises(HandshakeError, match="claimed by two processes"):
            chan.wait_ready(timeout_s=5)
    finally:
        for t in (a, b):
            t.halt.set()
            t.join(timeout=5)

    chan2 = StepChannel(2, output_rank=1)
    wrong = RankThread(chan2.endpoints, 0, output_rank=0)  # believes it is the output rank
    wrong.start()
    try:
        with pytest.raises(HandshakeError, match="output rank"):
            chan2.wait_ready(timeout_s=5)
    finally:
        wrong.halt.set()
        wrong.join(timeout=5)
        chan2.close()


def test_a_vanished_rank_fails_the_broadcast_with_a_typed_error(group) -> None:
    chan, ranks = group(2)
    chan.wait_ready(timeout_s=5)
    ranks[1].halt.set()
    ranks[1].join(timeout=5)
    deadline = time.monotonic() + 5
    with pytest.raises(RankDisconnectedError) as err:
        # The ROUTER drops the route once it sees the TCP connection close.
        while time.monotonic() < deadline:
            chan.broadcast(_decode_step(0, n=1))
            time.sleep(0.01)
    assert err.value.rank == 1 and err.value.node == "node-1"


def test_close_releases_the_ports() -> None:
    chan = StepChannel(1)
    endpoints = chan.endpoints
    chan.close()
    chan.close()  # idempotent
    with pytest.raises(WireError, match="closed"):
        chan.broadcast(_decode_step(0))
    ctx = zmq.Context()
    try:
        for endpoint in endpoints[:2]:
            sock = ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(endpoint)  # raises EADDRINUSE if the channel still held it
    finally:
        ctx.destroy(linger=0)


def test_errors_survive_pickling() -> None:
    for err in (
        StepTimeoutError(3, 1.5),
        HandshakeTimeoutError([1, 2], 30.0),
        RankDisconnectedError(1, "n", 9),
        StepReceiveTimeout(0.5),
    ):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)


def test_a_strangers_well_formed_frames_change_nothing(group) -> None:
    """Anything that reaches the ports without the engine's key is dropped: a fake hello, a
    fake output for the step in flight, a fake failure report."""
    chan, _ = group(1)
    chan.wait_ready(timeout_s=5)
    ctx = zmq.Context()
    try:
        stranger = ctx.socket(zmq.PUSH)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(chan.reply_endpoint)
        forged = FrameAuth.new()
        chan.broadcast(_decode_step(0))
        fake_out = ModelRunnerOutput(0, ["r0"], [[12345]])
        stranger.send_multipart([b"out", encode(fake_out)])
        stranger.send_multipart(forged.seal([b"out", encode(fake_out)]))
        stranger.send_multipart([b"fail", encode([0, "x", 0, "E", "forged", ""])])
        out = chan.recv_reply(timeout_s=5)
        assert out != fake_out and [12345] not in out.sampled_token_ids
        chan.broadcast(_decode_step(1))
        assert chan.recv_reply(timeout_s=5).step_id == 1
    finally:
        ctx.destroy(linger=0)
