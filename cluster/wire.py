"""The per-step control channel, controller side: one ``SchedulerOutput`` out to every rank, one
``ModelRunnerOutput`` back from the output rank.

Topology (the controller binds both sockets on its node's IP, port 0, and reports the endpoints):

- **step**: one ROUTER; each rank connects a DEALER. A rank's first frame on it is a hello, which
  is also how the ROUTER learns where that rank is. Each step is encoded once and the same bytes
  are addressed to every rank. Unlike PUB/SUB nothing can be dropped before a subscription lands
  (the slow-joiner problem): ``ROUTER_MANDATORY`` turns a send to a rank that is not connected
  into an error, and a full queue blocks only up to ``send_timeout_s``. One ROUTER instead of a
  PUSH per rank keeps it to one port and makes addressing explicit, so a rank can never take
  another rank's step the way PUSH round-robin would.
- **reply**: one PULL; each rank connects a PUSH. The output rank sends the step's output;
  any rank sends a failure frame when it fails, so the controller hears about a failure on every
  rank, not only on the output rank. Non-output ranks send nothing when a step succeeds: the
  per-step deadline plus the Ray-level monitor on the ranks' run loops cover a rank that dies
  without a word, so an ack per rank per step would only add traffic.

Readiness: every rank says hello on **both** sockets, carrying its rank, node and the wire
version; ``wait_ready`` returns once every rank has been heard on both paths, so the first step
can neither be lost nor wait on a half-connected rank.

Frames are multipart ``[kind, body]``; bodies go through ``pagedserve.messages.encode/decode``
(msgpack, no pickle); the envelopes (hello, failure) are plain msgpack lists, since this module
and ``workers/wire.py`` (the other half of the format) may not import each other.

Every wait is bounded and fails with a typed error. A channel instance belongs to one thread.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import zmq

from pagedserve.cluster.wire_frames import (
    BadFrameError,
    HandshakeError,
    HandshakeTimeoutError,
    RankDisconnectedError,
    RankInfo,
    StepTimeoutError,
    WireError,
    WorkerStepError,
    parse_hello,
)
from pagedserve.frame_auth import FrameAuth, FrameAuthError
from pagedserve.messages import (
    MessageDecodeError,
    ModelRunnerOutput,
    SchedulerOutput,
    StepFrame,
    decode,
    encode,
)
from pagedserve.net import is_ipv6, ms_left, tcp_endpoint

__all__ = ["StepChannel"]

logger = logging.getLogger(__name__)


def _recv_by(sock: zmq.Socket, deadline: float, auth: FrameAuth) -> list[bytes] | None:
    """The next authentic multipart message (its tag checked and removed), or None once
    ``deadline`` passes without one; frames that fail authentication are dropped and logged.

    A blocking receive bounded by RCVTIMEO: one call into libzmq on the hot path instead of a
    poll followed by a receive. With the deadline already past (0 ms) a message that is
    already queued is still taken.
    """
    while True:
        sock.setsockopt(zmq.RCVTIMEO, ms_left(deadline))
        try:
            frames = sock.recv_multipart()
        except zmq.Again:
            return None
        opened = _open(auth, frames, routed=sock.type == zmq.ROUTER)
        if opened is not None:
            return opened


def _open(auth: FrameAuth, frames: list[bytes], routed: bool) -> list[bytes] | None:
    """A ROUTER's frames start with the sender's identity, which is not part of the tag."""
    try:
        return [frames[0], *auth.open(frames[1:])] if routed else auth.open(frames)
    except FrameAuthError:
        logger.warning("dropped a frame that failed authentication (%d parts)", len(frames))
        return None


class StepChannel:
    """Controller end of the per-step channel for one worker group of ``world_size`` ranks.

    Usage: build it, hand ``endpoints`` to the ranks (e.g. as an argument of their run loop),
    ``wait_ready``, then per step ``broadcast(scheduler_output)`` and ``recv_reply(timeout_s)``.
    Steps may be pipelined: replies are matched to broadcasts in order.
    """

    def __init__(
        self,
        world_size: int,
        host: str = "127.0.0.1",
        output_rank: int = 0,
        send_timeout_s: float = 5.0,
    ) -> None:
        """Frames in both directions carry an HMAC with a secret made here and handed to the
        ranks inside ``endpoints`` (through Ray): a stranger's frame is dropped."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= output_rank < world_size:
            raise ValueError(f"output_rank must be in [0, {world_size}), got {output_rank}")
        if host in ("*", "0.0.0.0", "::", ""):
            # The bound address is handed to the ranks to connect to, so it must be a real one.
            raise ValueError(f"host must be this node's address (Ray's node IP), got {host!r}")
        self.world_size = world_size
        self.output_rank = output_rank
        self._auth = FrameAuth.new()
        self._send_timeout_s = send_timeout_s
        self._ctx = zmq.Context(io_threads=1)
        self._closed = False
        try:
            self._step = self._ctx.socket(zmq.ROUTER)
            self._reply = self._ctx.socket(zmq.PULL)
            for sock in (self._step, self._reply):
                sock.setsockopt(zmq.LINGER, 0)
                if is_ipv6(host):
                    sock.setsockopt(zmq.IPV6, 1)
            # Sending to an unknown or vanished rank must fail loudly, not drop the step.
            self._step.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # Ranks name their connection; if one reconnects after a network blip, the new
            # connection takes the route over instead of being refused as a duplicate.
            self._step.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self._step.setsockopt(zmq.SNDTIMEO, max(0, int(send_timeout_s * 1000)))
            self._step.bind(tcp_endpoint(host))
            self._reply.bind(tcp_endpoint(host))
        except Exception:
            self._ctx.destroy(linger=0)
            raise
        self.step_endpoint: str = self._step.getsockopt_string(zmq.LAST_ENDPOINT)
        self.reply_endpoint: str = self._reply.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()
        self._poller.register(self._step, zmq.POLLIN)
        self._poller.register(self._reply, zmq.POLLIN)
        # Handshake state: the ROUTER identity per rank, and whether its reply path spoke.
        self._routes: dict[int, bytes] = {}
        self._ranks: dict[int, RankInfo] = {}
        self._reply_seen: set[int] = set()
        self._ready = False
        # Steps broadcast and not yet answered, oldest first.
        self._in_flight: deque[int] = deque()

    # ------------------------------------------------------------------------------- set-up
    @property
    def endpoints(self) -> tuple[str, str, bytes]:
        """``(step_endpoint, reply_endpoint, frame key)``, the argument ``StepReceiver`` takes."""
        return (self.step_endpoint, self.reply_endpoint, self._auth.key)

    @property
    def ranks(self) -> dict[int, RankInfo]:
        """The ranks heard from so far, by rank."""
        return dict(self._ranks)

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def in_flight(self) -> list[int]:
        """Step ids broadcast and not yet answered, oldest first."""
        return list(self._in_flight)

    def wait_ready(self, timeout_s: float) -> dict[int, RankInfo]:
        """Wait until every rank has said hello on both sockets; returns them by rank.

        Raises ``HandshakeTimeoutError`` naming the missing ranks, ``HandshakeError`` on a
        contradictory hello, ``BadFrameError`` on a foreign frame (progress so far is kept, so
        the call can be repeated).
        """
        self._check_open()
        start = time.monotonic()
        deadline = start + timeout_s
        while not self._ready:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [
                    r
                    for r in range(self.world_size)
                    if r not in self._routes or r not in self._reply_seen
                ]
                raise HandshakeTimeoutError(missing, time.monotonic() - start)
            events = dict(self._poller.poll(ms_left(deadline)))
            if self._step in events:
                frames = _open(self._auth, self._step.recv_multipart(), routed=True)
                if frames is not None:
                    self._on_step_socket_frame(frames)
            if self._reply in events:
                frames = _open(self._auth, self._reply.recv_multipart(), routed=False)
                if frames is not None:
                    self._on_reply_socket_hello(frames)
            self._ready = len(self._routes) == self.world_size and len(self._reply_seen) == (
                self.world_size
            )
        return dict(self._ranks)

    def _on_step_socket_frame(self, frames: list[bytes]) -> None:
        # A DEALER's frames arrive behind the identity the ROUTER gave its connection.
        if len(frames) != 3 or frames[1] != StepFrame.HELLO:
            raise BadFrameError(f"unexpected frame on the step socket ({len(frames)} parts)")
        info = self._check_hello(parse_hello(frames[2]))
        route = self._routes.get(info.rank)
        if route is not None and route != frames[0]:
            raise HandshakeError(f"rank {info.rank} connected twice (second from {info.node})")
        self._routes[info.rank] = frames[0]

    def _on_reply_socket_hello(self, frames: list[bytes]) -> None:
        if len(frames) != 2 or frames[0] != StepFrame.HELLO:
            raise BadFrameError(f"unexpected frame on the reply socket before ready: {frames[:1]}")
        info = self._check_hello(parse_hello(frames[1]))
        if info.rank in self._reply_seen:
            raise HandshakeError(f"rank {info.rank} said hello twice on the reply socket")
        self._reply_seen.add(info.rank)

    def _check_hello(self, info: RankInfo) -> RankInfo:
        if not 0 <= info.rank < self.world_size:
            raise HandshakeError(f"rank {info.rank} is outside this group of {self.world_size}")
        if info.is_output_rank != (info.rank == self.output_rank):
            raise HandshakeError(
                f"rank {info.rank} thinks it is{'' if info.is_output_rank else ' not'} the "
                f"output rank; the controller expects rank {self.output_rank}"
            )
        known = self._ranks.get(info.rank)
        if known is not None and (known.node, known.pid) != (info.node, info.pid):
            raise HandshakeError(
                f"rank {info.rank} claimed by two processes: pid {known.pid} on {known.node} "
                f"and pid {info.pid} on {info.node}"
            )
        self._ranks[info.rank] = info
        return info

    # ----------------------------------------------------------------------------------------
    # Per step

    def broadcast(self, msg: SchedulerOutput) -> int:
        """Send one step to every rank (encoded once); returns the frame size in bytes."""
        self._check_open()
        if not self._ready:
            raise WireError("broadcast before wait_ready: not every rank is connected")
        if not isinstance(msg, SchedulerOutput):
            raise TypeError(f"broadcast takes a SchedulerOutput, got {type(msg).__name__}")
        frame = encode(msg)
        sealed = self._auth.seal([StepFrame.STEP, frame])  # one tag: the same bytes to all
        parts = lambda route: [route, *sealed]  # noqa: E731
        for rank in range(self.world_size):
            try:
                self._step.send_multipart(parts(self._routes[rank]))
            except zmq.Again as exc:
                raise StepTimeoutError(
                    msg.step_id, self._send_timeout_s, f"rank {rank} did not take the step"
                ) from exc
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    node = self._ranks[rank].node
                    raise RankDisconnectedError(rank, node, msg.step_id) from exc
                raise
        self._in_flight.append(msg.step_id)
        return len(frame)

    def recv_reply(self, timeout_s: float) -> ModelRunnerOutput:
        """The output of the oldest step in flight.

        Raises ``StepTimeoutError`` after ``timeout_s`` without it, ``WorkerStepError`` as soon as
        any rank reports a failure, ``BadFrameError`` on a frame outside the protocol (dropped;
        the step stays in flight, so calling again keeps waiting for it).
        """
        self._check_open()
        if not self._in_flight:
            raise WireError("recv_reply with no step in flight")
        expected = self._in_flight[0]
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            frames = _recv_by(self._reply, deadline, self._auth)
            if frames is None:
                raise StepTimeoutError(expected, time.monotonic() - start)
            kind = frames[0] if len(frames) == 2 else None
            if kind == StepFrame.OUTPUT:
                out = self._decode_output(frames[1], expected)
                self._in_flight.popleft()
                return out
            if kind == StepFrame.FAIL:
                raise self._decode_failure(frames[1])
            if kind in (StepFrame.HELLO, StepFrame.BYE):
                continue  # a late duplicate of set-up or tear-down traffic: harmless
            raise BadFrameError(f"unexpected frame on the reply socket: {frames[0][:16]!r}")

    def _decode_output(self, body: bytes, expected: int) -> ModelRunnerOutput:
        try:
            out = decode(body)
        except MessageDecodeError as exc:
            raise BadFrameError(f"undecodable step output: {exc}") from exc
        if not isinstance(out, ModelRunnerOutput):
            raise BadFrameError(f"step output is a {type(out).__name__}, not a ModelRunnerOutput")
        if out.step_id != expected:
            raise BadFrameError(f"output for step {out.step_id} while step {expected} is due")
        return out

    def _decode_failure(self, body: bytes) -> WorkerStepError:
        try:
            fields = decode(body)
        except MessageDecodeError as exc:
            raise BadFrameError(f"undecodable failure frame: {exc}") from exc
        if not isinstance(fields, list) or len(fields) != 6:
            raise BadFrameError(f"malformed failure frame: {fields!r:.200}")
        rank, node, step_id, exc_type, message, tb = fields
        if not isinstance(rank, int) or not (step_id is None or isinstance(step_id, int)):
            raise BadFrameError(f"malformed failure frame: {fields!r:.200}")
        return WorkerStepError(rank, str(node), str(message), step_id, str(exc_type), str(tb))

    # ----------------------------------------------------------------------------------------
    # Tear-down

    def stop_workers(self, timeout_s: float) -> list[int]:
        """Ask every connected rank to leave its receive loop; returns the ranks that did not
        confirm within ``timeout_s`` (best effort: the executor kills the actors anyway)."""
        self._check_open()
        for route in self._routes.values():
            try:
                self._step.send_multipart(
                    [route, *self._auth.seal([StepFrame.STOP, b""])], flags=zmq.NOBLOCK
                )
            except zmq.ZMQError:
                pass  # gone or full: it is not going to confirm, which the result reports
        pending = set(self._routes)
        deadline = time.monotonic() + timeout_s
        while pending:
            frames = _recv_by(self._reply, deadline, self._auth)
            if frames is None:
                break
            if len(frames) == 2 and frames[0] == StepFrame.BYE:
                try:
                    pending.discard(decode(frames[1])[0])
                except (MessageDecodeError, TypeError, IndexError, KeyError):
                    logger.warning("dropping a malformed bye frame")
        return sorted(pending)

    def close(self) -> None:
        """Close both sockets without lingering and release the ports. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._ctx.destroy(linger=0)

    def _check_open(self) -> None:
        if self._closed:
            raise WireError("the step channel is closed")

    def __enter__(self) -> StepChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"StepChannel(world_size={self.world_size}, step={self.step_endpoint}, "
            f"reply={self.reply_endpoint}, ready={self._ready})"
        )
