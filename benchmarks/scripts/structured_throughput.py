"""Constrained throughput: the same batch unconstrained and with a JSON-schema constraint on
every request, in alternating rounds, on SmolLM2-135M-Instruct (the default model) at bf16.

Reports the output tokens/s of each (the median over rounds), their ratio (target >= 0.9x)
and the controller's grammar mask time per step (``time_grammar_mask_s`` over
``num_grammar_mask_steps`` of the engine's stats), also as a share of the step.

Both sides generate exactly ``--max-tokens`` per request, so the rate compares what a step
costs, not how long the answers are: the unconstrained side ignores EOS, and the schema asks
for more records (``minItems``) than fit, so no constrained answer ends early. Alternating
the rounds spreads a noisy machine's drift over both sides alike. A warm-up round of each
(untimed) compiles the grammar and warms the kernels first.

    python benchmarks/scripts/structured_throughput.py --quick      # under a minute on a CPU
    python benchmarks/scripts/structured_throughput.py              # 32 requests x 256 tokens
    python benchmarks/scripts/structured_throughput.py --model DIR --dtype float16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

from pagedserve import LLM, SamplingParams
from pagedserve.messages import StructuredOutputsParams

# Strings, bounded integers, an enum and nesting: the usual pieces of an extraction schema.
RECORD = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["engineer", "designer", "manager", "analyst"]},
    "active": {"type": "boolean"},
}, "required": ["name", "age", "role", "active"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {
    "team": {"type": "string", "maxLength": 24},
    "members": {"type": "array", "items": RECORD, "minItems": 1000},
}, "required": ["team", "members"], "additionalProperties": False}
PROMPTS = ["List the members of team {i} as JSON records.",
           "Team {i}: give every member's name, age, role and status in JSON.",
           "Write the roster of project {i} as a JSON object."]


@dataclass(slots=True)
class Round:
    constrained: bool
    tokens: int
    seconds: float
    mask_s: float
    mask_steps: int
    step_s: float
    steps: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def _params(args: argparse.Namespace, constrained: bool, n_req: int) -> list[SamplingParams]:
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=args.compact)
    return [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=i,
                           ignore_eos=not constrained,
                           structured_outputs=constraint if constrained else None)
            for i in range(n_req)]


def run_round(llm: LLM, prompts: list[str], args: argparse.Namespace,
              constrained: bool) -> Round:
    params = _params(args, constrained, len(prompts))
    before = llm.stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    short = [o for o in outs if len(o.outputs[0].token_ids) != args.max_tokens]
    if short:  # an answer that ended early would make the two rates incomparable
        first = short[0].outputs[0]
        raise SystemExit(f"{len(short)} answers ended before --max-tokens "
                         f"({first.finish_reason}: {first.text[-80:]!r})")

    def delta(key: str) -> float:
        return float(after.get(key, 0)) - float(before.get(key, 0))

    return Round(constrained, tokens, seconds, delta("time_grammar_mask_s"),
                 int(delta("num_grammar_mask_steps")),
                 delta("time_schedule_s") + delta("time_execute_s"), int(delta("num_steps")))


def report(rounds: list[Round]) -> float:
    """Print the per-round table and the summary; the constrained/unconstrained ratio."""
    print("| round | constraint | output tokens | s | tok/s | mask ms/step | mask % of step |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for i, r in enumerate(rounds):
        per_step = 1000 * r.mask_s / r.mask_steps if r.mask_steps else 0.0
        share = 100 * r.mask_s / r.step_s if r.step_s else 0.0
        print(f"| {i // 2 + 1} | {'json schema' if r.constrained else 'none'} | {r.tokens} | "
              f"{r.seconds:.2f} | {r.tok_s:.1f} | {per_step:.3f} | {share:.1f}% |")
    free = statistics.median(r.tok_s for r in rounds if not r.constrained)
    held = [r for r in rounds if r.constrained]
    constrained = statistics.median(r.tok_s for r in held)
    mask_steps = sum(r.mask_steps for r in held)
    mask_ms = 1000 * sum(r.mask_s for r in held) / mask_steps if mask_steps else 0.0
    ratio = constrained / free
    print(f"unconstrained {free:.1f} tok/s, constrained {constrained:.1f} tok/s: "
          f"{ratio:.2f}x (target >= 0.9x); grammar mask {mask_ms:.3f} ms per step "
          f"over {mask_steps} steps")
    return ratio


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: SmolLM2)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None)
    p.add_argument("--backend", default="local")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3, help="rounds of each side, alternating")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--compact", action=argparse.BooleanOptionalAction, default=True,
                   help="only ', ' and ': ' between JSON tokens (a sampled small model left "
                        "free to add whitespace spends its tokens on it)")
    p.add_argument("--quick", action="store_true", help="8 requests x 32 tokens, 1 round")
    p.add_argument("--min-ratio", type=float, default=0.0,
                   help="exit 1 when constrained / unconstrained tok/s is below this")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens, args.rounds = 8, 32, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = {"dtype": args.dtype, "backend": args.backend}
    if args.quantization is not None:
        options["quantization"] = args.quantization
    llm = LLM(args.model, **options)
    try:
        prompts = [PROMPTS[i % len(PROMPTS)].format(i=i) for i in range(args.requests)]
        for constrained in (False, True):  # warm-up: kernels, and the grammar compiled
            run_round(llm, prompts[:2], args, constrained)
        rounds = [run_round(llm, prompts, args, constrained)
                  for _ in range(args.rounds) for constrained in (False, True)]
    finally:
        llm.shutdown()
    print(f"{args.requests} requests x {args.max_tokens} tokens, {args.rounds} rounds, "
          f"dtype {args.dtype}, temperature {args.temperature}")
    ratio = report(rounds)
    return 1 if ratio < args.min_ratio else 0


if __name__ == "__main__":
    sys.exit(main())
