"""``pagedserve serve``: the OpenAI-compatible server from the command line.

``cli.py`` calls ``add_serve_parser(subparsers)`` to register the sub-command and dispatches
to ``run_serve(args)``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

__all__ = ["add_serve_parser", "engine_options", "run_serve"]

logger = logging.getLogger(__name__)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` sub-command to an ``argparse`` sub-parsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a checkpoint over the OpenAI API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics).",
    )
    p.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--dcp", type=int, default=1, help="decode-context-parallel size")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (behind a router)")
    p.add_argument("--address", default=None, help="Ray address ('auto' joins a cluster)")
    p.add_argument("--backend", default=None, choices=["ray", "local"],
                   help="ray (default; or $PAGEDSERVE_BACKEND) or local: the engine in this "
                   "process, one rank, no Ray")
    return p


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flat ``from_flat`` options the parsed arguments ask for."""
    return {
        "dtype": args.dtype,
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "num_gpu_blocks": args.num_gpu_blocks,
        "enable_prefix_caching": not args.no_prefix_caching,
        "tensor_parallel_size": args.tp,
        "decode_context_parallel_size": args.dcp,
        "data_parallel_size": args.dp,
        "ray_address": args.address,
    }


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted; 0 on a clean stop, 2 on a bad configuration."""
    from pagedserve.config import ConfigError, from_flat
    from pagedserve.controller.api_server import serve
    from pagedserve.controller.launch import resolve_model_dir

    logging.getLogger("pagedserve").setLevel(args.log_level.upper())
    if args.model is None:
        print("pagedserve: no --model given, serving the built-in demo checkpoint "
              "(random weights: the text is meaningless)", file=sys.stderr)
    try:
        config = from_flat(model=resolve_model_dir(args.model), **engine_options(args))
    except ConfigError as exc:
        print(f"pagedserve serve: invalid option {exc}", file=sys.stderr)
        return 2
    print(f"pagedserve: serving on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        serve(config, args.host, args.port, args.api_key, backend=args.backend,
              log_level=args.log_level)
    except KeyboardInterrupt:
        pass
    return 0
