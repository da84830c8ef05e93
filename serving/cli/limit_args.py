"""The ``serve`` options that fill ``ServerLimits``: one flag per field, defaults from the
dataclass itself. For every limit and timeout, 0 means none."""

from __future__ import annotations

import argparse
from typing import Any

from pagedserve.serving.openai.limits import ServerLimits

__all__ = ["add_limit_arguments", "limits_from_args"]

_D = ServerLimits()

# (flag, field, type, help)
_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--max-body-bytes", "max_body_bytes", int,
     "largest request body, refused with 413 while it is read (/v1/files uploads have their "
     "own limit)"),
    ("--max-prompt-chars", "max_prompt_chars", int,
     "longest prompt in characters, refused before tokenizing"),
    ("--max-stop-strings", "max_stop_strings", int, "stop strings per request"),
    ("--max-stop-chars", "max_stop_chars", int, "characters per stop string"),
    ("--max-logprob-entries", "max_logprob_entries", int,
     "logprob entries one answer may carry: prompts x n x (echoed prompt tokens + max_tokens) "
     "x (1 + logprobs)"),
    ("--header-timeout", "header_timeout_s", float,
     "seconds for a connection's request headers to arrive (then 408 and close)"),
    ("--body-timeout", "body_timeout_s", float,
     "seconds for a request body to arrive after its headers (then 408)"),
    ("--write-timeout", "write_timeout_s", float,
     "seconds a stream may wait for a client that stopped reading; then its requests are "
     "aborted"),
)


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("limits", "what one request may cost (0: no limit)")
    for flag, name, kind, text in _FLAGS:
        default = getattr(_D, name)
        shown = (
            "32 per token of the context" if default is None
            else f"{default:g}" if kind is float else default
        )
        group.add_argument(flag, type=kind, default=None, metavar="N",
                           help=f"{text} (default {shown})")
    group.add_argument("--cpu-workers", type=int, default=_D.cpu_workers, metavar="N",
                       help="threads that tokenize and build answers off the event loop "
                            f"(default {_D.cpu_workers})")


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    """The ``ServerLimits`` of parsed ``serve`` arguments; ``ValueError`` for a bad one."""
    values: dict[str, Any] = {"cpu_workers": args.cpu_workers}
    for flag, name, _, _ in _FLAGS:
        given = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if given is None:
            continue
        if given < 0:
            raise ValueError(f"{flag} must be >= 0 (0: no limit), got {given}")
        values[name] = None if given == 0 else given
    return ServerLimits(**values)
