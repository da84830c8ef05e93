"""The per-step control channel, worker side: receive each step's ``SchedulerOutput``, send the
output rank's ``ModelRunnerOutput`` back, and report a failure from any rank.

The controller binds a ROUTER (steps) and a PULL (replies); a rank connects a DEALER to the first
and a PUSH to the second and says hello on both (see ``pagedserve/cluster/wire.py`` for why).
Per step only the output rank replies; a non-output rank is silent unless it fails, in which case
it sends a failure frame (``reply_error``) so the controller learns of the failure at once and
with the rank's own message instead of waiting out the step deadline.

Frames are multipart ``[kind, body]`` with bodies from ``pagedserve.messages.encode``. The two
ends may not import each other, so the frame kinds, the envelope layouts and the wire version
live in ``messages.StepFrame`` and the endpoint format in ``pagedserve.net``, which both import;
``tests/test_wire.py`` runs this end against the controller's.

A receiver instance belongs to the thread that uses it. Every wait is bounded.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from collections.abc import Sequence

import zmq

from pagedserve.frame_auth import FrameAuth, FrameAuthError
from pagedserve.messages import (
    MessageDecodeError,
    ModelRunnerOutput,
    SchedulerOutput,
    StepFrame,
    decode,
    encode,
)
from pagedserve.net import is_ipv6, ms_left, parse_tcp_endpoint

logger = logging.getLogger(__name__)

__all__ = [
    "BadStepFrameError",
    "ChannelStopped",
    "ControllerUnreachableError",
    "ReceiverError",
    "StepReceiveTimeout",
    "StepReceiver",
]


# A failure frame carries the end of the traceback only: enough to name the root cause once,
# small enough never to matter on the wire.
_MAX_TRACEBACK_CHARS = 4000


class ReceiverError(RuntimeError):
    """Base class of the worker-side channel errors."""


class StepReceiveTimeout(ReceiverError, TimeoutError):
    """No step arrived within the wait; the channel is intact (an idle engine sends nothing)."""

    def __init__(self, waited_s: float) -> None:
        super().__init__(f"no step from the controller within {waited_s:.3f} s")
        self.waited_s = waited_s

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.waited_s,))


class ControllerUnreachableError(ReceiverError, ConnectionError):
    """A frame for the controller could not be handed over within the send deadline."""


class BadStepFrameError(ReceiverError, ValueError):
    """A frame from the controller that is not a step; it is dropped and the receiver stays
    usable."""


class ChannelStopped(ReceiverError):
    """The controller asked this rank to leave its receive loop."""


class StepReceiver:
    """One rank's end of the step channel.

    ``endpoints`` is ``StepChannel.endpoints``: ``(step_endpoint, reply_endpoint, key)``; every
    frame either way carries an HMAC with that key, and frames without a valid one (a
    stranger's) are dropped. Construction
    connects and says hello on both sockets, waiting for each connection at most
    ``send_timeout_s`` (``ControllerUnreachableError`` otherwise). ``node`` names the rank in
    the controller's errors (pass the Ray node id; the host name by default).
    """

    def __init__(
        self,
        endpoints: Sequence[str | bytes],
        rank: int,
        is_output_rank: bool,
        node: str | None = None,
        send_timeout_s: float = 10.0,
    ) -> None:
        if len(endpoints) != 3 or not all(isinstance(e, str) for e in endpoints[:2]):
            raise ValueError(
                f"endpoints must be (step_endpoint, reply_endpoint, key), got {endpoints!r:.200}"
            )
        step_endpoint, reply_endpoint, key = endpoints
        assert isinstance(step_endpoint, str) and isinstance(reply_endpoint, str)
        self._auth = FrameAuth(key)  # type: ignore[arg-type]
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.rank = rank
        self.is_output_rank = is_output_rank
        self.node = node if node is not None else socket.gethostname()
        self.last_step_id: int | None = None
        self._send_timeout_s = send_timeout_s
        self._closed = False
        self._ctx = zmq.Context(io_threads=1)
        try:
            self._step = self._ctx.socket(zmq.DEALER)
            self._reply = self._ctx.socket(zmq.PUSH)
            for sock, endpoint in ((self._step, step_endpoint), (self._reply, reply_endpoint)):
                sock.setsockopt(zmq.LINGER, 0)
                # Queue nothing for a connection that is not up: a send waits for it, never
                # longer than the send deadline, so a wrong or dead controller address fails
                # here with a typed error instead of leaving the hello parked in a queue.
                sock.setsockopt(zmq.IMMEDIATE, 1)
                sock.setsockopt(zmq.SNDTIMEO, max(0, int(send_timeout_s * 1000)))
                if is_ipv6(parse_tcp_endpoint(endpoint)[0]):
                    sock.setsockopt(zmq.IPV6, 1)
            # A stable name lets the controller's ROUTER keep routing to this rank if the TCP
            # connection is re-established.
            routing_id = f"r{rank}:{os.getpid()}:{self.node}".encode()[:255]  # zmq's limit
            self._step.setsockopt(zmq.ROUTING_ID, routing_id)
            self._step.connect(step_endpoint)
            self._reply.connect(reply_endpoint)
            hello = encode([StepFrame.VERSION, rank, self.node, os.getpid(), is_output_rank])
            self._send(self._step, [StepFrame.HELLO, hello], "hello on the step socket")
            self._send(self._reply, [StepFrame.HELLO, hello], "hello on the reply socket")
        except Exception:
            self._ctx.destroy(linger=0)
            raise

    def recv(self, timeout_s: float) -> SchedulerOutput:
        """The next step. Raises ``StepReceiveTimeout`` when none arrives within ``timeout_s``,
        ``ChannelStopped`` when the controller says stop, ``BadStepFrameError`` on garbage."""
        self._check_open()
        start = time.monotonic()
        # A blocking receive bounded by RCVTIMEO: one call into libzmq per step, not a poll and
        # then a receive.
        while True:
            self._step.setsockopt(zmq.RCVTIMEO, ms_left(start + timeout_s))
            try:
                frames = self._step.recv_multipart()
            except zmq.Again:
                raise StepReceiveTimeout(time.monotonic() - start) from None
            try:
                frames = self._auth.open(frames)
                break
            except FrameAuthError:
                logger.warning("rank %d: dropped a frame that failed authentication", self.rank)
        if len(frames) == 2 and frames[0] == StepFrame.STEP:
            try:
                step = decode(frames[1])
            except MessageDecodeError as exc:
                raise BadStepFrameError(f"undecodable step frame: {exc}") from exc
            if not isinstance(step, SchedulerOutput):
                raise BadStepFrameError(f"step frame holds a {type(step).__name__}")
            self.last_step_id = step.step_id
            return step
        if len(frames) == 2 and frames[0] == StepFrame.STOP:
            # Confirm, so the controller's stop_workers knows this rank left its loop.
            self._send(self._reply, [StepFrame.BYE, encode([self.rank])], "bye", quiet=True)
            raise ChannelStopped(f"rank {self.rank}: the controller closed the step channel")
        raise BadStepFrameError(f"unexpected frame from the controller: {frames[0][:16]!r}")

    def reply(self, out: ModelRunnerOutput) -> None:
        """Send the step's output; only the output rank replies."""
        self._check_open()
        if not self.is_output_rank:
            raise ValueError(f"rank {self.rank} is not the output rank; only failures go back")
        if not isinstance(out, ModelRunnerOutput):
            raise TypeError(f"reply takes a ModelRunnerOutput, got {type(out).__name__}")
        self._send(self._reply, [StepFrame.OUTPUT, encode(out)], f"output of step {out.step_id}")

    def reply_error(self, exc: BaseException, step_id: int | None = None) -> None:
        """Report a failure to the controller (any rank). ``step_id`` defaults to the last step
        received. Best effort and bounded: a controller that is gone is not an error here."""
        if self._closed:
            return
        sid = self.last_step_id if step_id is None else step_id
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        body = encode(
            [self.rank, self.node, sid, type(exc).__name__, str(exc), tb[-_MAX_TRACEBACK_CHARS:]]
        )
        self._send(self._reply, [StepFrame.FAIL, body], "failure report", quiet=True)

    def close(self) -> None:
        """Close both sockets without lingering. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._ctx.destroy(linger=0)

    def _send(self, sock: zmq.Socket, frames: list[bytes], what: str, quiet: bool = False) -> None:
        try:
            sock.send_multipart(self._auth.seal(frames))
        except zmq.Again as exc:
            if quiet:
                return
            raise ControllerUnreachableError(
                f"rank {self.rank}: could not send the {what} to the controller within "
                f"{self._send_timeout_s:.1f} s"
            ) from exc

    def _check_open(self) -> None:
        if self._closed:
            raise ReceiverError(f"rank {self.rank}: the step receiver is closed")

    def __enter__(self) -> StepReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
