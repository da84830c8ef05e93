"""Every message that crosses a process boundary, and its msgpack codec.

The codec is explicit: each message class has a small integer type tag, a message travels as a
msgpack extension whose payload is the list of its fields in declaration order, and decoding
rebuilds the dataclass by tag. No pickle: an unknown tag, a wrong field count or a frame that is
not msgpack raises ``MessageDecodeError``.

``SchedulerOutput`` carries deltas only: a request is sent in full once, in
``new_reqs``; afterwards only its new block ids, newly appended token ids and computed-token
count travel, in ``cached_reqs``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack

from pagedserve.request_outputs import CompletionDelta as CompletionDelta  # re-exported
from pagedserve.request_outputs import CompletionOutput as CompletionOutput
from pagedserve.request_outputs import RequestDelta as RequestDelta
from pagedserve.request_outputs import RequestOutput as RequestOutput
from pagedserve.sampling_params import SamplingParams as SamplingParams  # re-exported
from pagedserve.sampling_params import SamplingParamsError as SamplingParamsError
from pagedserve.sampling_params import StructuredOutputsParams as StructuredOutputsParams

# --------------------------------------------------------------------------------------------
# Controller <-> workers

PLACEHOLDER_TOKEN = -1
"""In ``CachedRequestData.new_token_ids``: the token the workers sampled for this request in
an earlier step whose output the controller had not yet received when it scheduled this one
(async scheduling). Each worker writes its own sample there."""


@dataclass(frozen=True, slots=True)
class LayerKVSpec:
    """What one attention layer needs per token of KV, as a worker reports it."""

    num_kv_heads: int
    head_size: int
    dtype_bytes: int
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """A worker's answer after loading its model: per-layer KV needs and its byte budget."""

    layer_specs: list[LayerKVSpec]
    available_kv_bytes: int
    vocab_size: int
    max_model_len: int
    device: str
    draft_layer_specs: list[LayerKVSpec] = field(default_factory=list)
    """Speculative decoding with a draft model: its attention layers. Each keeps its KV in
    tensors of its own indexed by the target's block ids, so every block costs their bytes
    too (``controller/kv_plan.py``)."""


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """The controller's decision on the KV pool, sent to every worker once.

    Block ids are drawn from one pool of ``num_blocks`` shared by all groups. Every group has the
    same number of layers, so the worker allocates ``len(groups[0])`` tensors and layer
    ``groups[g][j]`` uses tensor ``j`` (block ids never collide across groups).
    """

    num_blocks: int
    block_size: int
    groups: list[list[int]]
    num_host_blocks: int = 0
    """Blocks of the host-memory tier (same per-block shape, own ids); 0: no tier."""
    draft_groups: list[int] = field(default_factory=list)
    """Per draft-model layer (``WorkerReport.draft_layer_specs``), the target group whose block
    table it reads: it writes its own KV tensor at the same slots, so the target's allocations,
    trims and copies carry it along."""


@dataclass(slots=True)
class NewRequestData:
    """A request scheduled for the first time (or again after preemption), sent in full."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Non-empty only for a request resumed after preemption: its tokens are recomputed."""
    sampling_params: SamplingParams
    block_ids: list[list[int]]
    """Block ids per KV group."""
    num_computed_tokens: int


@dataclass(slots=True)
class CachedRequestData:
    """Running requests, column-wise to keep a 256-request decode step small on the wire."""

    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    """Tokens appended since the request was last scheduled (the last sampled one, usually),
    then a ``PLACEHOLDER_TOKEN`` for each sample still in flight."""
    new_block_ids: list[list[list[int]] | None] = field(default_factory=list)
    """Per request, per group, the block ids appended since last step; None when none were."""
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's decision, broadcast to every rank."""

    step_id: int
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[str] = field(default_factory=list)
    """Requests to drop from the workers' batches: finished, aborted or preempted."""
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """Copy-on-write ``(src, dst)`` block copies to run before the forward pass."""
    blocks_to_host: list[tuple[int, int]] = field(default_factory=list)
    """Host-tier ``(device src, host dst)`` copies (swap-outs, evicted prefix blocks); run
    first, before ``blocks_to_device``."""
    blocks_to_device: list[tuple[int, int]] = field(default_factory=list)
    """Host-tier ``(host src, device dst)`` copies (swap-ins, host prefix hits); run after
    ``blocks_to_host`` and before ``block_copies`` and the forward pass."""
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Speculative tokens to verify, per request that has any: they follow its known tokens
    and count in its ``num_scheduled_tokens``; the worker samples every one of their positions
    (plus the last known token's) and returns the accepted ones. Empty without a drafter."""
    block_table_trims: dict[str, int] = field(default_factory=dict)
    """Requests whose rejected drafts left tail blocks holding nothing, which the controller
    gave back: each of their block-table rows keeps its first ``n`` blocks. Applied after the
    drops and before this step's appended blocks; ids a worker does not hold are skipped."""
    token_masks: dict[str, bytes] = field(default_factory=dict)
    """Per request under a structured-output constraint that samples this step, the tokens
    each of its sampled positions may take (its last known token's, then one per draft): rows
    of ``W`` little-endian int32 words each (``32 * W >= vocab_size``), bit ``t % 32`` of word
    ``t // 32`` set when token ``t`` is allowed."""
    num_lookahead_tokens: int = 0
    """Slots the scheduler reserved past each request's chunk (where the blocks allowed it) for
    drafts a draft model proposes on the workers after this step: they propose up to this many
    per request that samples (``ModelRunnerOutput.draft_token_ids``). 0: propose none."""
    num_decode_steps: int = 1
    """Decode passes in this step (> 1 only when every scheduled request decodes one token and
    none has drafts or a grammar mask): each sampling row feeds its sample back and samples
    again, up to this many tokens, as far as the lookahead slots its blocks hold, its
    ``max_tokens``, ``max_model_len`` and its first stop token allow
    (``workers/multi_step.py``)."""


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled tokens of the requests whose scheduled tokens reached their end this step."""

    step_id: int
    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    """Per request, the tokens it accepted this step, in order: one without drafts; with
    ``k`` drafts, the drafts that matched the model's own samples and then one more sample
    (1 to ``k + 1`` tokens); with ``num_decode_steps`` n, 1 to n samples."""
    logprobs: list[list[tuple[list[int], list[float]]] | None] | None = None
    """Per request (None: not asked for), per accepted token: token ids ``[sampled, top_1, ...,
    top_N]`` and their log-probabilities."""
    prompt_logprobs: dict[str, tuple[int, list[list[int]], list[list[float]]]] | None = None
    """Requests that asked for prompt logprobs and computed prompt tokens this step (sampling
    or not): ``(first, ids, logprobs)``, where row ``i`` is prompt position ``first + i`` (>= 1):
    ids ``[prompt token, top_1, ..., top_N]`` and their log-probabilities."""
    request_errors: dict[str, str] = field(default_factory=dict)
    """New requests this rank could not take (a value the controller's checks missed), with
    the error: none of their tokens was computed this step. Decided from the request's own
    data, so every rank rejects the same ones."""
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """With ``SchedulerOutput.num_lookahead_tokens``: per request that sampled, the draft
    model's greedy guesses of the tokens after the ones it accepted, for the next step."""


# --------------------------------------------------------------------------------------------
# Clients <-> the engine loop (in-process, or over ZeroMQ through cluster/ray_controller.py)


@dataclass(slots=True)
class AddRequest:
    """Client -> controller: admit a request. Answered by one ``AddResult``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    cache_salt: str | None = None
    priority: int = 0
    """Under the ``priority`` scheduling policy, lower is served first."""
    resume: ResumeState | None = None
    """Set when a front end resubmits a request whose controller died: what the client has
    already received of it, from which the new controller carries on."""
    final_only: bool = False
    """One delta, when the request finishes, instead of one per step: for a client that reads
    only final outputs (``LLM.generate``), so a step costs it no message. A controller that
    dies takes the request's progress with it; the new one starts it over."""


@dataclass(slots=True)
class ResumeState:
    """What a client has received of a request, per completion (index order), when it moves
    the request to a new controller (``controller.resume``). The new engine replays these
    tokens as if it had sampled them, sends only what follows, and computes their KV again."""

    token_ids: list[list[int]]
    num_chars: list[int]
    """Characters of text received: the engine holds back the rest of the replayed text (a
    stop string may still match across it) and sends it later, as the old one would have."""
    cumulative_logprobs: list[float | None]
    finished: list[bool]
    """A finished completion is not run again (its final delta was received)."""
    num_prompt_logprobs: int = 0
    """Prompt positions whose logprobs were received (position 0's None included)."""


@dataclass(slots=True)
class AbortRequest:
    """Client -> controller: abort a request (idempotent; unknown ids are ignored)."""

    request_id: str


@dataclass(slots=True)
class AddResult:
    """Engine -> client: whether an ``AddRequest`` was accepted. ``error_type`` names the
    refusal (see ``controller.errors.error_code``); None: accepted."""

    request_id: str
    error_type: str | None = None
    error_message: str | None = None


@dataclass(slots=True)
class OutputBatch:
    """Engine -> client: everything of one engine-loop iteration for that client: the verdicts
    on its adds, then the step's deltas of its requests (request ids as the client sent them)."""

    results: list[AddResult]
    outputs: list[RequestDelta]


@dataclass(slots=True)
class StatusRequest:
    """Client -> controller: ask for an ``EngineStatus`` (also the client's heartbeat)."""

    seq: int = 0


@dataclass(slots=True)
class EngineStatus:
    """Controller -> client: health and the engine's latest stats snapshot. Sent in answer to
    ``StatusRequest`` (same ``seq``), and unprompted (``seq`` -1) when the engine dies."""

    healthy: bool
    stats: dict[str, Any]
    error: str | None = None
    seq: int = 0


class StepFrame:
    """Kinds of the step channel's frames (``[kind, body]``) between ``cluster/wire.py`` and
    ``workers/wire.py``. Bump ``VERSION`` on any change, so mismatched builds fail at the
    handshake."""

    VERSION = 8
    HELLO = b"hello"  # rank -> controller, on both sockets: [version, rank, node, pid, is_output]
    STEP = b"step"  # controller -> rank: encode(SchedulerOutput)
    STOP = b"stop"  # controller -> rank: empty body; the rank answers BYE and leaves its loop
    OUTPUT = b"out"  # output rank -> controller: encode(ModelRunnerOutput)
    FAIL = b"fail"  # any rank -> controller: [rank, node, step_id, exc_type, message, traceback]
    BYE = b"bye"  # rank -> controller: [rank]


# --------------------------------------------------------------------------------------------
# The codec


class MessageDecodeError(ValueError):
    """A frame that is not a well-formed message of a known type."""


# Tags are part of the wire format: append new classes, never renumber.
_TAGGED: tuple[type, ...] = (
    SamplingParams,
    CompletionOutput,
    RequestOutput,
    LayerKVSpec,
    WorkerReport,
    KVCacheLayout,
    NewRequestData,
    CachedRequestData,
    SchedulerOutput,
    ModelRunnerOutput,
    AddRequest,
    AbortRequest,
    AddResult,
    OutputBatch,
    StatusRequest,
    EngineStatus,
    CompletionDelta,
    RequestDelta,
    StructuredOutputsParams,
    ResumeState,
)
_TAG_OF: dict[type, int] = {cls: i + 1 for i, cls in enumerate(_TAGGED)}
_CLS_OF: dict[int, type] = {i: cls for cls, i in _TAG_OF.items()}
_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _TAGGED
}



def _default(obj: Any) -> Any:
    tag = _TAG_OF.get(type(obj))
    if tag is None:
        raise TypeError(f"cannot encode {type(obj).__name__}: not a registered message")
    values = [getattr(obj, name) for name in _FIELDS[type(obj)]]
    return msgpack.ExtType(tag, msgpack.packb(values, default=_default, use_bin_type=True))


def _ext_hook(tag: int, payload: bytes) -> Any:
    cls = _CLS_OF.get(tag)
    if cls is None:
        raise MessageDecodeError(f"unknown message type tag {tag}")
    values = msgpack.unpackb(payload, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    names = _FIELDS[cls]
    if not isinstance(values, list) or len(values) != len(names):
        raise MessageDecodeError(f"malformed {cls.__name__}: expected {len(names)} fields")
    try:
        return cls(**dict(zip(names, values, strict=True)))
    except (TypeError, ValueError) as exc:
        raise MessageDecodeError(f"malformed {cls.__name__}: {exc}") from exc


def encode(obj: Any) -> bytes:
    """Encode a message (or plain msgpack data containing messages) to bytes."""
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def decode_message(data: bytes, types: tuple[type, ...]) -> Any:
    """``decode``, and the result must be one of ``types``: a socket that expects messages
    never hands on plain data or a message of another kind."""
    msg = decode(data)
    if not isinstance(msg, types):
        raise MessageDecodeError(f"expected {' or '.join(t.__name__ for t in types)}, "
                                 f"got {type(msg).__name__}")
    return msg


def decode(data: bytes) -> Any:
    """Decode bytes made by ``encode``; raises ``MessageDecodeError`` on anything else."""
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except MessageDecodeError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise MessageDecodeError(f"not a valid message frame: {exc}") from exc

