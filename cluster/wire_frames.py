"""The step channel's frame-level pieces: the hello a rank sends, and the typed errors of what
can go wrong between the controller and its ranks (each pickles with its fields: it may cross
a Ray call out of the controller actor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.messages import MessageDecodeError, StepFrame, decode


class WireError(RuntimeError):
    """Base class of the step channel's errors."""


class HandshakeError(WireError):
    """A rank's hello contradicts the channel's setup (duplicate or unknown rank, wrong output
    rank, another wire version)."""


class HandshakeTimeoutError(HandshakeError, TimeoutError):
    """Not every rank said hello on both sockets before the deadline."""

    def __init__(self, missing: list[int], waited_s: float) -> None:
        super().__init__(
            f"ranks {missing} did not connect to the step channel within {waited_s:.1f} s "
            "(still loading, crashed, or unable to reach the controller's address?)"
        )
        self.missing = missing
        self.waited_s = waited_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.missing, self.waited_s))


class StepTimeoutError(WireError, TimeoutError):
    """A step's reply (or its hand-off to a rank) did not happen within the deadline."""

    def __init__(self, step_id: int, waited_s: float, what: str = "no reply from the output rank"):
        super().__init__(f"step {step_id}: {what} within {waited_s:.3f} s")
        self.step_id = step_id
        self.waited_s = waited_s
        self.what = what

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.step_id, self.waited_s, self.what))


class WorkerStepError(WireError):
    """A rank reported that it failed; carries the rank, its node and the worker's message."""

    def __init__(
        self,
        rank: int,
        node: str,
        message: str,
        step_id: int | None = None,
        exc_type: str = "",
        traceback: str = "",
    ) -> None:
        at = f" at step {step_id}" if step_id is not None else ""
        what = f"{exc_type}: {message}" if exc_type else message
        super().__init__(f"rank {rank} on node {node} failed{at}: {what}")
        self.rank = rank
        self.node = node
        self.message = message
        self.step_id = step_id
        self.exc_type = exc_type
        self.traceback = traceback

    def __reduce__(self) -> tuple[Any, ...]:
        args = (self.rank, self.node, self.message, self.step_id, self.exc_type, self.traceback)
        return (type(self), args)


class RankDisconnectedError(WireError):
    """A step could not be addressed to a rank because its connection is gone."""

    def __init__(self, rank: int, node: str, step_id: int) -> None:
        super().__init__(f"step {step_id}: rank {rank} on node {node} is no longer connected")
        self.rank = rank
        self.node = node
        self.step_id = step_id

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.node, self.step_id))


class BadFrameError(WireError, ValueError):
    """A frame that is not part of the protocol. It is dropped; the channel stays usable and the
    call that met it may simply be repeated."""


# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankInfo:
    """What a rank told the channel in its hello."""

    rank: int
    node: str
    pid: int
    is_output_rank: bool


def parse_hello(body: bytes) -> RankInfo:
    try:
        fields = decode(body)
    except MessageDecodeError as exc:
        raise BadFrameError(f"undecodable hello: {exc}") from exc
    if not isinstance(fields, list) or len(fields) != 5:
        raise BadFrameError(f"malformed hello: {fields!r:.200}")
    version, rank, node, pid, is_output = fields
    if version != StepFrame.VERSION:
        raise HandshakeError(
            f"rank {rank} speaks wire version {version!r}, the controller {StepFrame.VERSION} "
            "(mixed pagedserve builds across nodes?)"
        )
    ok = (
        isinstance(rank, int)
        and isinstance(node, str)
        and isinstance(pid, int)
        and isinstance(is_output, bool)
    )
    if not ok:
        raise BadFrameError(f"malformed hello: {fields!r:.200}")
    return RankInfo(rank, node, pid, is_output)
