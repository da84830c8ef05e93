"""``pagedserve generate``: its options, and the command around the JSONL job.

With ``--input``/``--output`` it runs ``jsonl_job.job.run_job``; without, the plain form: each
``--prompt`` through the engine, completions printed to stdout. ``--address`` is handed to
``start_engine`` (None: a fresh local Ray instance, ``auto``: attach to a running Ray cluster;
``--backend local`` keeps the engine in this process).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import sys
from typing import Any

from pagedserve.config import ConfigError
from pagedserve.controller.client import EngineClient
from pagedserve.controller.errors import EngineDeadError
from pagedserve.controller.outputs import final_output_sink
from pagedserve.messages import AddRequest, RequestOutput, SamplingParams, SamplingParamsError
from pagedserve.serving.chat import ChatError, render_chat, user_turn
from pagedserve.serving.cli.engine_args import add_engine_arguments, engine_options
from pagedserve.serving.jsonl_job.job import nothing_left, run_job


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``generate`` options (job, sampling defaults, engine) to ``parser``."""
    job = parser.add_argument_group("batch job")
    job.add_argument("--input", default=None, metavar="IN.jsonl",
                     help="JSONL requests, one per line (prompt | prompt_token_ids | messages)")
    job.add_argument("--output", default=None, metavar="OUT.jsonl",
                     help="JSONL results, appended as requests finish; rerunning with the same "
                          "file skips the ids it already holds")
    job.add_argument("--max-in-flight", type=int, default=None, metavar="N",
                     help="requests submitted and not yet finished (default: 2 x max-num-seqs)")
    job.add_argument("--progress", choices=["auto", "bar", "log", "none"], default="auto",
                     help="a tqdm bar on a terminal, log lines otherwise (default: auto)")
    job.add_argument("--prompt", action="append", default=[],
                     help="a prompt (repeatable); used when there is no --input")
    job.add_argument("--chat", action="append", default=[], metavar="QUESTION",
                     help="a user message, sent through the model's chat template (repeatable; "
                          "each is its own conversation); used when there is no --input")
    job.add_argument("--system", default=None, metavar="TEXT",
                     help="a system message placed before each --chat question")
    job.add_argument("--json", action="store_true",
                     help="without --input: one JSON object per completion on stdout")

    samp = parser.add_argument_group("sampling defaults (an input line's own fields win)")
    samp.add_argument("--max-tokens", type=int, default=32)
    samp.add_argument("--temperature", type=float, default=0.0)
    samp.add_argument("--top-p", type=float, default=1.0)
    samp.add_argument("--top-k", type=int, default=0)
    samp.add_argument("--n", type=int, default=1, help="completions per prompt")
    samp.add_argument("--seed", type=int, default=None)
    samp.add_argument("--stop", action="append", default=None, metavar="TEXT",
                      help="a stop string (repeatable)")
    samp.add_argument("--ignore-eos", action="store_true")

    add_engine_arguments(parser)


def sampling_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The command line's sampling options as ``SamplingParams`` keyword arguments."""
    out: dict[str, Any] = {
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k, "n": args.n, "seed": args.seed, "ignore_eos": args.ignore_eos,
    }
    if args.stop:
        out["stop"] = list(args.stop)
    return out


def _start_client(args: argparse.Namespace) -> EngineClient:
    from pagedserve.builder import resolve_model_dir, start_engine
    from pagedserve.config import from_flat

    from_flat(**engine_options(args))  # the options first: the model may need converting
    model_dir = resolve_model_dir(getattr(args, "model", None))
    return start_engine(from_flat(model=model_dir, **engine_options(args)), args.backend)


def _generate_prompts(client: EngineClient, args: argparse.Namespace) -> int:
    """The plain form: each ``--prompt`` (and each ``--chat`` question, through the chat
    template) through the engine, completions printed to stdout."""
    params = SamplingParams(**sampling_defaults(args))
    if client.tokenizer is None:
        print("pagedserve: the model has no tokenizer; use --input with prompt_token_ids",
              file=sys.stderr)
        return 2
    # (label, prompt text, prompt ids): plain prompts, then chat questions through the template.
    items = [(text, text, client.tokenizer.encode(text)) for text in args.prompt]
    try:
        for question in args.chat:
            conversation = user_turn(question, args.system)
            items.append((question, *render_chat(client.tokenizer, conversation)))
    except ChatError as exc:
        print(f"pagedserve generate: --chat: {exc}", file=sys.stderr)
        return 2
    if not items:
        default = "Hello, my name is"
        items = [(default, default, client.tokenizer.encode(default))]
    prompts = [label for label, _, _ in items]
    results: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
    for i, (_, text, ids) in enumerate(items):
        add = AddRequest(f"prompt-{i}", ids, params, text, final_only=True)
        client.add_request(add, final_output_sink(add, results.put))
    outs: dict[str, RequestOutput] = {}
    while len(outs) < len(prompts):
        try:
            out = results.get(timeout=1.0)
        except queue.Empty:
            if not client.is_healthy():
                raise EngineDeadError("the engine stopped before finishing the prompts") from None
            continue
        outs[out.request_id] = out
    status = 0
    for i, text in enumerate(prompts):
        out = outs[f"prompt-{i}"]
        if out.error is not None:
            print(f"pagedserve: prompt {i} failed: {out.error}", file=sys.stderr)
            status = 1
            continue
        for comp in out.outputs:
            if args.json:
                print(json.dumps({
                    "prompt": text, "index": comp.index, "text": comp.text,
                    "token_ids": comp.token_ids, "finish_reason": comp.finish_reason,
                }))
            else:
                print(f"--- prompt: {text!r} [{comp.index}] "
                      f"({len(comp.token_ids)} tokens, {comp.finish_reason})")
                print(comp.text)
    stats = client.stats()
    print(
        f"pagedserve: {stats.get('num_steps', 0)} steps, "
        f"{stats.get('time_execute_s', 0.0):.2f}s in the model, "
        f"{stats.get('time_schedule_s', 0.0):.3f}s scheduling, "
        f"{stats.get('num_preemptions', 0)} preemptions",
        file=sys.stderr,
    )
    return status


def run_generate_job(args: argparse.Namespace) -> int:
    """``pagedserve generate``: the batch job with ``--input``, the plain form without it."""
    if args.input is not None and args.output is None:
        print("pagedserve generate: --input needs --output", file=sys.stderr)
        return 2
    if args.input is not None and not os.path.isfile(args.input):
        print(f"pagedserve generate: no such input file: {args.input}", file=sys.stderr)
        return 2
    if args.max_in_flight is not None and args.max_in_flight < 1:
        print("pagedserve generate: --max-in-flight must be >= 1", file=sys.stderr)
        return 2
    try:
        defaults = sampling_defaults(args)
        SamplingParams(**defaults)
    except SamplingParamsError as exc:
        print(f"pagedserve generate: invalid sampling option {exc}", file=sys.stderr)
        return 2
    done = None if args.input is None else nothing_left(args.input, args.output)
    if done is not None:  # a rerun after the last line was written: no engine to start
        print(f"pagedserve generate: {done.describe()}", file=sys.stderr)
        return done.exit_status
    try:
        client = _start_client(args)
    except ConfigError as exc:  # an unknown --model among them
        print(f"pagedserve generate: invalid option {exc}", file=sys.stderr)
        return 2
    try:
        if args.input is None:
            return _generate_prompts(client, args)
        max_in_flight = args.max_in_flight or 2 * int(getattr(args, "max_num_seqs", 128) or 128)
        summary = run_job(client, args.input, args.output, defaults,
                          max_in_flight=max_in_flight, progress=args.progress)
    finally:
        client.shutdown()
    print(f"pagedserve generate: {summary.describe()}", file=sys.stderr)
    if summary.failed:
        lines = ", ".join(map(str, summary.failed_lines[:20]))
        more = " ..." if len(summary.failed_lines) > 20 else ""
        print(f"pagedserve generate: {summary.failed} failed request(s), see the error records "
              f"in {args.output} (input lines {lines}{more})", file=sys.stderr)
    if summary.engine_error:
        print(f"pagedserve generate: the engine died ({summary.engine_error}); "
              f"{summary.not_done} request(s) not done, rerun the same command to finish them",
              file=sys.stderr)
    return summary.exit_status


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedserve.serving.cli.generate``: the command without the CLI wrapper."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="pagedserve generate")
    add_generate_arguments(parser)
    return run_generate_job(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
