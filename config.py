"""The frozen configuration tree: Model / Cache / Parallel / Scheduler -> EngineConfig.

Every class is a frozen, slotted dataclass validated once in ``__post_init__``; nothing writes
to a config after construction. Facts discovered at run time (the number of KV blocks a worker
can hold, EOS ids, the KV spec) travel in messages, never back into the config.

Only the top-level objects (engine core, worker) receive the tree; low-level classes such as
``BlockPool`` or ``BlockTable`` take plain values.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ALLOCATION_POLICIES = ("paged", "reserve")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD")
DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3")
# Bytes per element of each named dtype (the KV arithmetic of code that has no torch).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1}
QUANTIZATIONS = ("auto", "none", "int8", "gguf")
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")


def cache_root() -> Path:
    """Where pagedserve keeps files between runs (converted checkpoints, batches):
    ``$XDG_CACHE_HOME/pagedserve``, ``~/.cache/pagedserve`` without the variable."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedserve"


class FieldError(ValueError):
    """An invalid value of a named field; ``field`` names it (``ConfigError`` for the engine
    configuration, ``SamplingParamsError`` for a request's sampling parameters)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Crosses process boundaries (Ray) with its own constructor's arguments.
        return (type(self), (self.field, self.message))


class ConfigError(FieldError):
    """An invalid configuration value; ``field`` names the offending field."""


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(name, f"must be {allowed}, got {value}")


def _check_optional_int(name: str, value: Any, lo: int) -> None:
    if value is not None:
        _check_int(name, value, lo)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(name, f"must be one of {', '.join(choices)}; got {value!r}")


def kv_element_bytes(kv_cache_dtype: str, model_dtype: str) -> int:
    """Bytes per KV element for ``kv_cache_dtype`` under a model of ``model_dtype`` (a
    resolved name: not ``auto``)."""
    _check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    _check_choice("dtype", model_dtype, tuple(d for d in DTYPES if d != "auto"))
    return DTYPE_BYTES[model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which checkpoint to serve and how to load it."""

    model: str = ""
    """Hugging Face checkpoint directory (config.json + safetensors). Front ends resolve what
    the user named first (``workers/checkpoints.py``: none is SmolLM2-135M-Instruct, a
    ``.gguf`` file is converted once, ``"demo"`` the random demo checkpoint). Empty here: the
    demo checkpoint."""
    tokenizer: str | None = None
    dtype: str = "auto"
    """``auto`` keeps the checkpoint dtype (bf16 becomes float32 on CPU)."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; None takes the checkpoint's limit."""
    seed: int = 0
    quantization: str = "auto"
    """Linear weights: ``int8`` weight-only per output channel; ``gguf`` a GGUF file's Q4_0 /
    Q4_1 / Q8_0 blocks as stored (CPU); ``none`` the weights as loaded (a GGUF file
    dequantized); ``auto`` is ``gguf`` for a converted GGUF file, ``none`` otherwise
    (``workers/quantize.py``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str):
            raise ConfigError("model", f"must be a path string, got {self.model!r}")
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        _check_optional_int("max_model_len", self.max_model_len, 1)
        _check_int("seed", self.seed, 0)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache: block geometry, capacity and prefix caching."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks: int | None = None
    """Fix the number of KV blocks (overrides the byte budget); the null block is included."""
    kv_cache_memory_bytes: int | None = None
    """Byte budget for the KV pool per worker; None: measured free memory on GPU, 1 GiB on CPU."""
    gpu_memory_utilization: float = 0.9
    allocation_policy: str = "paged"
    """``paged`` allocates on demand; ``reserve`` holds ceil(max_model_len / B) blocks at
    admission (the contiguous pre-allocation baseline of the experiments)."""
    host_kv_cache_bytes: int = 0
    """Byte budget of the host-memory KV tier per worker (``--swap-space`` GiB); 0: no tier.
    Pinned host memory on GPU machines, plain memory on CPU ones."""
    num_host_blocks: int | None = None
    """Fix the number of host-tier blocks (overrides the byte budget; null block included)."""
    kv_offload: bool = True
    """With a host tier: keep cached blocks evicted from the device pool there, so a later
    prefix hit copies them back instead of recomputing them."""
    kv_cache_dtype: str = "auto"
    """The KV cache's own dtype: ``auto`` (the model's), ``bfloat16`` (2 bytes per element) or
    ``fp8_e4m3`` (1 byte, scaled per layer for K and for V as vLLM does; saturates at +-448).
    The byte budget then holds 2x / 4x the tokens of a float32 model."""
    calculate_kv_scales: bool = False
    """fp8 only: each layer takes its K and V scales from the amax of the first prefill
    (x 2 headroom), instead of 1.0."""

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1, 1024)
        if self.block_size & (self.block_size - 1):
            raise ConfigError("block_size", f"must be a power of two, got {self.block_size}")
        _check_optional_int("num_gpu_blocks", self.num_gpu_blocks, 2)
        _check_optional_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {u!r}")
        _check_choice("allocation_policy", self.allocation_policy, ALLOCATION_POLICIES)
        _check_int("host_kv_cache_bytes", self.host_kv_cache_bytes, 0)
        _check_optional_int("num_host_blocks", self.num_host_blocks, 2)
        if not isinstance(self.kv_offload, bool):
            raise ConfigError("kv_offload", f"must be a bool, got {self.kv_offload!r}")
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if not isinstance(self.calculate_kv_scales, bool):
            raise ConfigError(
                "calculate_kv_scales", f"must be a bool, got {self.calculate_kv_scales!r}"
            )

    @property
    def host_tier_enabled(self) -> bool:
        return self.num_host_blocks is not None or self.host_kv_cache_bytes > 0


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How one engine replica is split over ranks, and how replicas are placed."""

    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    """Ranks of a TP group that would replicate KV heads instead shard tokens; divides tp."""
    dcp_interleave: int = 1
    """Tokens per rank in a row of the interleaved context-parallel layout (1 or block size)."""
    data_parallel_size: int = 1
    placement_strategy: str = "PACK"
    ray_address: str | None = None
    """None starts a local Ray instance; ``auto`` attaches to a running cluster."""

    def __post_init__(self) -> None:
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 512)
        _check_int("decode_context_parallel_size", self.decode_context_parallel_size, 1, 512)
        if self.tensor_parallel_size % self.decode_context_parallel_size:
            raise ConfigError(
                "decode_context_parallel_size",
                f"must divide tensor_parallel_size={self.tensor_parallel_size}, "
                f"got {self.decode_context_parallel_size}",
            )
        _check_int("dcp_interleave", self.dcp_interleave, 1)
        _check_int("data_parallel_size", self.data_parallel_size, 1, 1024)
        _check_choice("placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The token budget of one step and the batch limits."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    max_pending_requests: int = 4096
    """Requests the engine holds at once (running, waiting and queued adds); more are refused
    with ``EngineOverloadedError`` (HTTP 503) instead of queueing without bound."""
    preemption_mode: str = "recompute"
    """``recompute`` frees a preempted request's blocks and computes them again on resume;
    ``swap`` copies them to the host tier and back (recompute when the tier is full)."""
    scheduling_policy: str = "fcfs"
    """``fcfs``: first come, first served; ``priority``: by each request's ``priority`` (lower
    first), then arrival, and the KV cache's victim is the lowest-priority request running."""
    async_scheduling: bool = True
    """Schedule each step while the one before it runs, where the executor can overlap them
    (one Ray worker rank): the controller's share of a step leaves the critical path. Steps
    run one at a time under speculative decoding or while a structured-output request runs,
    and the step after one that adds requests waits for it."""
    num_scheduler_steps: int = 8
    """Decode passes the workers run per step message while a small batch (at most
    ``MULTI_STEP_MAX_SEQS`` requests, ``controller/decode_steps.py``) only decodes and nothing
    waits: the controller's round trip is paid once per this many tokens. Tokens then reach a
    stream this many at a time, and a request that arrives meanwhile waits for the message.
    1: one pass per message."""

    def __post_init__(self) -> None:
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_pending_requests", self.max_pending_requests, 1)
        _check_int("num_scheduler_steps", self.num_scheduler_steps, 1)
        _check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (``speculative_config``, spelled as vLLM spells it): a proposer on
    the controller guesses up to ``num_speculative_tokens`` tokens per request and step, and
    the workers verify them in the same forward pass (``draft_model``: a smaller model on the
    workers guesses them, right after the step that verified the previous ones). ``method=None``:
    off."""

    method: str | None = None
    """``ngram``: prompt lookup (the last n tokens matched against the request's own prompt
    and output); ``suffix``: suffix trees over the request and recent requests' outputs;
    ``draft_model``: greedy drafts of the checkpoint named by ``model``."""
    model: str | None = None
    """``draft_model``: the draft's Hugging Face checkpoint directory, a smaller model with the
    target's vocabulary; loaded on every worker like the target (same dtype, sharded the same
    way), its KV in the target's blocks (``docs/architecture.md``, Speculative decoding)."""
    num_speculative_tokens: int = 5
    """The most drafts per request and step (suffix drafts are often fewer: their length
    follows the match)."""
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    """``ngram``: the shortest and longest suffix looked up; the longest that occurs wins."""
    disable_by_batch_size: int | None = 16
    """Speculation pauses while this many requests or more run: a full batch already keeps
    the machine busy, and drafts would only take token budget from it. None: never."""
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    """``suffix``: how long a suffix the trees hold, and how many recent requests' outputs
    the global tree keeps (vLLM keeps 10000; outputs that overlap each other cost up to
    ``max_tree_depth`` tree nodes a token in this pure-Python tree)."""
    suffix_decoding_max_spec_factor: float = 1.0
    """``suffix``: drafts at most this many tokens per matched token."""
    suffix_decoding_min_token_prob: float = 0.1
    """``suffix``: a draft stops where the tree's estimate that it is right falls below."""

    def __post_init__(self) -> None:
        if self.method is not None:
            _check_choice("speculative_config.method", self.method, SPECULATIVE_METHODS)
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ConfigError("speculative_config.model",
                              f"method 'draft_model' needs a checkpoint directory, got "
                              f"{self.model!r}")
        if self.model is not None and self.method != "draft_model":
            raise ConfigError("speculative_config.model",
                              f"only method 'draft_model' takes a model (method is "
                              f"{self.method!r})")
        _check_int("speculative_config.num_speculative_tokens", self.num_speculative_tokens,
                   1, 64)
        _check_int("speculative_config.prompt_lookup_min", self.prompt_lookup_min, 1)
        _check_int("speculative_config.prompt_lookup_max", self.prompt_lookup_max,
                   self.prompt_lookup_min)
        _check_optional_int("speculative_config.disable_by_batch_size",
                            self.disable_by_batch_size, 1)
        _check_int("speculative_config.suffix_decoding_max_tree_depth",
                   self.suffix_decoding_max_tree_depth, 1)
        _check_int("speculative_config.suffix_decoding_max_cached_requests",
                   self.suffix_decoding_max_cached_requests, 0)
        for name in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ConfigError(f"speculative_config.{name}",
                                  f"must be a number >= 0, got {value!r}")

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> SpeculativeConfig:
        """From ``LLM(speculative_config={...})`` or ``--speculative-config JSON``; an unknown
        key is refused by name."""
        if options is None:
            return cls()
        if not isinstance(options, dict):
            raise ConfigError("speculative_config", f"must be an object, got {options!r}")
        for key in options:
            if key not in cls.__dataclass_fields__:
                raise ConfigError(f"speculative_config.{key}", "unknown option")
        return cls(**options)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The whole tree, passed down from the top-level objects."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.cache.block_size % self.parallel.dcp_interleave:
            raise ConfigError(
                "dcp_interleave",
                f"must divide block_size={self.cache.block_size}, "
                f"got {self.parallel.dcp_interleave}",
            )
        dcp = self.parallel.decode_context_parallel_size
        if self.speculative.method == "draft_model" and dcp > 1:
            # The draft's layers share the target's block tables, whose slots a rank holds
            # only for its own share of the tokens under DCP.
            raise ConfigError(
                "speculative_config.method",
                f"'draft_model' does not run with decode_context_parallel_size > 1 (got {dcp}); "
                "use ngram or suffix drafts",
            )
        if self.scheduler.preemption_mode == "swap" and not self.cache.host_tier_enabled:
            raise ConfigError(
                "preemption_mode",
                "'swap' needs a host KV tier: set host_kv_cache_bytes (--swap-space) or "
                "num_host_blocks",
            )
        mml = self.model.max_model_len
        if (
            mml is not None
            and not self.scheduler.enable_chunked_prefill
            and self.scheduler.max_num_batched_tokens < mml
        ):
            raise ConfigError(
                "max_num_batched_tokens",
                f"must be >= max_model_len={mml} when chunked prefill is off",
            )

    def replace(self, **sections: Any) -> EngineConfig:
        """A new tree with whole sections or section fields replaced: ``replace(cache={...})``."""
        updates: dict[str, Any] = {}
        for name, value in sections.items():
            current = getattr(self, name)
            updates[name] = (
                dataclasses.replace(current, **value) if isinstance(value, dict) else value
            )
        return dataclasses.replace(self, **updates)


def from_flat(**kwargs: Any) -> EngineConfig:
    """Build the tree from the flat keyword arguments of ``LLM(...)`` and the CLI.

    Unknown names raise ``ConfigError`` rather than being ignored.
    """
    owners = {
        "model": ModelConfig,
        "cache": CacheConfig,
        "parallel": ParallelConfig,
        "scheduler": SchedulerConfig,
    }
    sections: dict[str, dict[str, Any]] = {name: {} for name in owners}
    speculative = SpeculativeConfig.from_dict(kwargs.pop("speculative_config", None))
    for key, value in kwargs.items():
        for section, cls in owners.items():
            if key in cls.__dataclass_fields__:
                sections[section][key] = value
                break
        else:
            raise ConfigError(key, "unknown engine option")
    return EngineConfig(
        model=ModelConfig(**sections["model"]),
        cache=CacheConfig(**sections["cache"]),
        parallel=ParallelConfig(**sections["parallel"]),
        scheduler=SchedulerConfig(**sections["scheduler"]),
        speculative=speculative,
    )
