"""``pagedserve serve``: the OpenAI-compatible server from the command line.

``cli.py`` calls ``add_serve_parser(subparsers)`` to register the sub-command and dispatches
to ``run_serve(args)``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from pagedserve.serving.cli.engine_args import add_engine_arguments, engine_options
from pagedserve.serving.cli.limit_args import add_limit_arguments, limits_from_args
from pagedserve.serving.reasoning_parsers import REASONING_PARSERS
from pagedserve.serving.tool_parsers import TOOL_CALL_PARSERS

__all__ = [
    "API_KEY_ENV", "add_serve_parser", "allowed_origins", "api_key", "engine_options",
    "run_serve",
]

logger = logging.getLogger(__name__)

API_KEY_ENV = "PAGEDSERVE_API_KEY"


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` sub-command to an ``argparse`` sub-parsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a checkpoint over the OpenAI API (/v1/completions, "
        "/v1/chat/completions, /v1/responses, /v1/models, /tokenize, /detokenize, the Batch "
        "API under /v1/files and /v1/batches, /health, /metrics).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health; "
                        "a flag is readable by every local user in /proc/PID/cmdline, so "
                        f"prefer --api-key-file or ${API_KEY_ENV}")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file (its first line, surrounding "
                        f"whitespace stripped); without either flag, ${API_KEY_ENV} is used "
                        "when set")
    p.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="let control-token text in chat messages (such as </s>) become real "
                        "tokens; by default it is tokenized as plain text, so that only the "
                        "chat template writes control tokens")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                   help="how tool_choice auto reads the model's tool calls from its text "
                        "(default: the format the chat template's own syntax shows)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split a thinking model's reasoning (<think>...</think>) off its chat "
                        "answers, as reasoning_content")
    p.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="origins whose browser pages may call the server (CORS): a comma "
                        "list, or a JSON list as vLLM takes it; '*' for any (default: none)")
    p.add_argument("--batch-dir", default=None,
                   help="where the Batch API keeps its files and batches (default: "
                        "$XDG_CACHE_HOME/pagedserve/batches, ~/.cache without it); unfinished "
                        "batches found there resume when the server starts")
    p.add_argument("--batch-max-in-flight", type=int, default=4,
                   help="batch lines in the engine at once, at most; new lines start only "
                        "while no interactive request is in progress or waiting (default 4)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_limit_arguments(p)
    add_engine_arguments(p)
    return p


def allowed_origins(value: str | None) -> list[str]:
    """``--allowed-origins``: ``a,b`` or ``["a", "b"]``; raises ``ValueError`` on a bad list."""
    if value is None or not value.strip():
        return []
    if value.lstrip().startswith("["):
        try:
            origins = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--allowed-origins is not a JSON list: {exc}") from None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise ValueError("--allowed-origins must list strings")
        return origins
    return [o.strip() for o in value.split(",") if o.strip()]


def api_key(args: argparse.Namespace) -> str | None:
    """The key from ``--api-key``, ``--api-key-file`` or ``$PAGEDSERVE_API_KEY`` (in that
    order; both flags at once is an error); None: no key. Raises ValueError."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give one of --api-key and --api-key-file, not both")
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read --api-key-file: {exc}") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file} holds no key")
        return key
    if args.api_key is not None:
        if not args.api_key:
            raise ValueError("--api-key is empty")
        return str(args.api_key)
    return os.environ.get(API_KEY_ENV) or None


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted; 0 on a clean stop, 2 on a bad configuration."""
    from pagedserve.builder import resolve_model_dir
    from pagedserve.config import ConfigError, from_flat
    from pagedserve.serving.batch_api.store import default_batch_dir
    from pagedserve.serving.openai.server import serve

    logging.getLogger("pagedserve").setLevel(args.log_level.upper())
    if args.batch_max_in_flight < 1:
        print("pagedserve serve: --batch-max-in-flight must be >= 1", file=sys.stderr)
        return 2
    try:
        limits = limits_from_args(args)
        key = api_key(args)
        origins = allowed_origins(args.allowed_origins)
    except ValueError as exc:
        print(f"pagedserve serve: {exc}", file=sys.stderr)
        return 2
    if args.model is None:
        print("pagedserve: no --model given, serving the default model "
              "SmolLM2-135M-Instruct", file=sys.stderr)
    try:
        from_flat(**engine_options(args))  # the options first: the model may need converting
        config = from_flat(model=resolve_model_dir(args.model), **engine_options(args))
    except ConfigError as exc:
        print(f"pagedserve serve: invalid option {exc}", file=sys.stderr)
        return 2
    print(f"pagedserve: serving on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        serve(config, args.host, args.port, key, backend=args.backend,
              log_level=args.log_level, batch_dir=args.batch_dir or default_batch_dir(),
              batch_max_in_flight=args.batch_max_in_flight, limits=limits,
              allow_special_tokens_in_content=args.allow_special_tokens_in_content,
              allowed_origins=origins, tool_call_parser=args.tool_call_parser,
              reasoning_parser=args.reasoning_parser)
    except KeyboardInterrupt:
        pass
    return 0
