"""The ``pagedserve`` console entry: generate | serve | bench | demo-model."""

from __future__ import annotations

import argparse
import logging
import sys

from pagedserve import __version__
from pagedserve.benchmarks.cli import add_bench_parser, run_bench
from pagedserve.serving.cli.generate import add_generate_arguments, run_generate_job
from pagedserve.serving.cli.serve import add_serve_parser, run_serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="A distributed LLM serving engine built on PagedAttention.",
    )
    parser.add_argument("--version", action="version", version=f"pagedserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="generate completions: --prompt TEXT, or a JSONL batch job with --input/--output",
    )
    add_generate_arguments(gen)

    add_serve_parser(sub)
    add_bench_parser(sub)

    demo = sub.add_parser("demo-model", help="write the demo checkpoint to DIR")
    demo.add_argument("dir")
    return parser


def _demo_model(args: argparse.Namespace) -> int:
    from pagedserve.workers.demo import write_demo_checkpoint

    path = write_demo_checkpoint(args.dir)
    print(f"wrote the demo checkpoint (random weights) to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate":
        return run_generate_job(args)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "bench":
        return run_bench(args, sys.argv[1:] if argv is None else argv)
    if args.command == "demo-model":
        return _demo_model(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
