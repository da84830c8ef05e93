"""The ``pagedserve`` console entry: generate | demo-model (serve and bench follow)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from pagedserve import __version__
from pagedserve.controller.serve_cli import add_serve_parser, run_serve


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
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


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
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
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="A distributed LLM serving engine built on PagedAttention.",
    )
    parser.add_argument("--version", action="version", version=f"pagedserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate completions for prompts")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per output line")

    add_serve_parser(sub)

    demo = sub.add_parser("demo-model", help="write the demo checkpoint to DIR")
    demo.add_argument("dir")
    return parser


def _generate(args: argparse.Namespace) -> int:
    from pagedserve.controller.llm import LLM
    from pagedserve.messages import SamplingParams

    prompts = args.prompt or ["Hello, my name is"]
    params = SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos,
    )
    with LLM(args.model, **_engine_options(args)) as llm:
        outputs = llm.generate(prompts, params)
        for out in outputs:
            for comp in out.outputs:
                if args.json:
                    print(json.dumps({
                        "prompt": out.prompt, "index": comp.index, "text": comp.text,
                        "token_ids": comp.token_ids, "finish_reason": comp.finish_reason,
                    }))
                else:
                    print(f"--- prompt: {out.prompt!r} [{comp.index}] "
                          f"({len(comp.token_ids)} tokens, {comp.finish_reason})")
                    print(comp.text)
        stats = llm.stats()
    print(
        f"pagedserve: {stats['num_steps']} steps, "
        f"{stats['time_execute_s']:.2f}s in the model, {stats['time_schedule_s']:.3f}s scheduling, "
        f"{stats['num_preemptions']} preemptions",
        file=sys.stderr,
    )
    return 0


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
        return _generate(args)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "demo-model":
        return _demo_model(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
