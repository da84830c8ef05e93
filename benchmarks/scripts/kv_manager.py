"""KV block manager micro-benchmark: a ShareGPT-like trace replayed as a scheduler would.

256 requests run at once; each step every running request decodes one token, finished requests
are freed and new arrivals admitted (prefix lookup + prompt allocation) to refill the batch.
Every request starts with the same system prompt, so admissions get prefix hits. Lengths are
truncated log-normals fitted to ShareGPT (input mu=4.434 sigma=1.2, output mu=5.435 sigma=1.0,
both in [4, 2048]; pairs over max_model_len rejected). Seeded.

Prints: microseconds of KV-manager work per scheduler step (manager calls plus the request's
token append / block hashing), median and p90 over the steady-state steps; the prefix-hit rate;
and memory utilisation (token slots holding real tokens / token slots allocated) for the
``paged`` policy against ``reserve`` (max_model_len blocks per request from admission), sampled
over the run.

    python benchmarks/scripts/kv_manager.py                       # full run
    python benchmarks/scripts/kv_manager.py --quick               # small run
    python benchmarks/scripts/kv_manager.py --dump-trace /tmp/kv_trace.json

The dumped trace is implementation independent (num_blocks is sized so no allocation can fail):
{"block_size": B, "num_blocks": N, "system_prompt_len": S, "steps": [[op, ...], ...]} with ops
  ["admit", rid, prompt_token_ids, first_output_token]: get_computed_blocks; allocate_slots(req,
      len(prompt) - hit, hit, hit_blocks); num_computed = len(prompt); append the first token.
  ["decode", rid, token]: allocate_slots(req, 1); num_computed += 1; append token.
  ["free", rid]: free(req).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import time
from typing import Any

import numpy as np

from pagedserve.kv import BlockHasher, KVCacheManager

Op = list[Any]


class TraceRequest:
    """The request view the KV manager reads (``pagedserve.kv.KVRequest``). Its prompt blocks
    are hashed by the timed loop, not here: creating the request is the scheduler's work."""

    __slots__ = ("request_id", "all_token_ids", "num_computed_tokens", "block_hashes", "hasher")
    cache_salt = None

    def __init__(self, request_id: str, prompt: list[int], hasher: BlockHasher) -> None:
        self.request_id = request_id
        self.all_token_ids = list(prompt)
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        self.hasher = hasher

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_token_id(self, token_id: int) -> None:
        toks = self.all_token_ids
        toks.append(token_id)
        # Only a token that completes a block can produce a hash: skip the call otherwise.
        if len(toks) % self.hasher.block_size == 0:
            self.hasher.extend(self.block_hashes, toks, None)


def sample_lengths(rng: np.random.Generator, mu: float, sigma: float, lo: int, hi: int) -> int:
    while True:
        n = int(round(rng.lognormal(mu, sigma)))
        if lo <= n <= hi:
            return n


def make_trace(
    seed: int,
    num_running: int,
    num_steps: int,
    block_size: int,
    max_model_len: int,
    system_prompt_len: int,
    vocab: int = 32000,
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, size=system_prompt_len).tolist()
    next_id = 0
    live: dict[str, list[int]] = {}  # rid -> [tokens allocated so far, outputs left]
    steps: list[list[Op]] = []
    peak_blocks = 0

    def new_request() -> Op:
        nonlocal next_id
        while True:
            n_in = sample_lengths(rng, 4.434, 1.2, 4, 2048)
            n_out = sample_lengths(rng, 5.435, 1.0, 4, 2048)
            if system_prompt_len + n_in + n_out <= max_model_len:
                break
        rid = f"req-{next_id}"
        next_id += 1
        prompt = system + rng.integers(0, vocab, size=n_in).tolist()
        live[rid] = [len(prompt), n_out - 1]
        return ["admit", rid, prompt, int(rng.integers(0, vocab))]

    for _ in range(num_steps):
        ops: list[Op] = []
        for rid, state in list(live.items()):
            if state[1] == 0:  # every output token sampled: finished
                ops.append(["free", rid])
                del live[rid]
        for rid, state in live.items():
            ops.append(["decode", rid, int(rng.integers(0, vocab))])
            state[0] += 1
            state[1] -= 1
        while len(live) < num_running:
            ops.append(new_request())
        steps.append(ops)
        peak_blocks = max(peak_blocks, sum(-(-s[0] // block_size) for s in live.values()))
    # Every live request's blocks counted without any sharing, plus the null block: no
    # allocation in this trace can fail under any correct manager, so nothing is preempted.
    return {
        "block_size": block_size,
        "num_blocks": peak_blocks + 1,
        "system_prompt_len": system_prompt_len,
        "steps": steps,
    }


def replay(
    trace: dict[str, Any], policy: str, num_blocks: int, max_model_len: int, sample_every: int
) -> dict[str, Any]:
    bs = trace["block_size"]
    mgr = KVCacheManager(None, num_blocks, bs, max_model_len, enable_caching=True, policy=policy)  # type: ignore[arg-type]
    hasher = BlockHasher(mgr.block_size)
    reqs: dict[str, TraceRequest] = {}
    step_ns: list[int] = []
    util: list[float] = []
    peak_used = 0
    perf = time.perf_counter_ns
    gc_was_enabled = gc.isenabled()
    gc.disable()  # keep collector pauses out of per-step timings; collect between steps
    try:
        for step_idx, ops in enumerate(trace["steps"]):
            # Resolve ids and build request objects outside the timed region: that is the
            # scheduler's work (its Request is created on arrival), not the KV manager's.
            resolved = []
            for op in ops:
                if op[0] == "admit":
                    r = reqs[op[1]] = TraceRequest(op[1], op[2], hasher)
                    resolved.append((0, r, op[3]))
                elif op[0] == "decode":
                    resolved.append((1, reqs[op[1]], op[2]))
                else:
                    resolved.append((2, reqs.pop(op[1]), 0))
            t0 = perf()
            for kind, r, tok in resolved:
                if kind == 1:
                    if mgr.allocate_slots(r, 1) is None:
                        raise RuntimeError("allocation failed: trace num_blocks too small")
                    r.num_computed_tokens += 1
                    r.append_token_id(tok)
                elif kind == 0:
                    hasher.extend(r.block_hashes, r.all_token_ids, None)
                    hit_blocks, hit = mgr.get_computed_blocks(r)
                    n = r.num_tokens
                    if mgr.allocate_slots(r, n - hit, hit, hit_blocks) is None:
                        raise RuntimeError("allocation failed: trace num_blocks too small")
                    r.num_computed_tokens = n
                    r.append_token_id(tok)
                else:
                    mgr.free(r)
            step_ns.append(perf() - t0)
            used = mgr.pool.num_usable_blocks - mgr.num_free_blocks
            peak_used = max(peak_used, used)
            if step_idx % sample_every == 0 and used:
                util.append(float(mgr.block_fill_snapshot().sum()) / (used * mgr.block_size))
            if step_idx % 64 == 0:
                gc.collect()
    finally:
        if gc_was_enabled:
            gc.enable()
    mgr.check_integrity()
    stats = mgr.prefix_cache_stats
    return {
        "step_ns": step_ns,
        "util": util,
        "peak_used": peak_used,
        "hit_rate": stats.hit_rate,
        "hits": stats.hits,
        "queries": stats.queries,
    }


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 running, 150 steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--system-prompt-len", type=int, default=100)
    ap.add_argument("--sample-every", type=int, default=10)
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="replays of the paged run; each step's time is its minimum over them "
        "(filters out noise from other processes on a shared machine)",
    )
    ap.add_argument("--dump-trace", metavar="PATH", help="write the op trace as JSON and exit")
    ap.add_argument("--no-reserve", action="store_true", help="skip the reserve-policy replay")
    args = ap.parse_args()
    if args.quick:
        args.running, args.steps = 64, 150

    t0 = time.perf_counter()
    trace = make_trace(
        args.seed,
        args.running,
        args.steps,
        args.block_size,
        args.max_model_len,
        args.system_prompt_len,
    )
    n_ops = sum(len(s) for s in trace["steps"])
    print(
        f"trace: {args.steps} steps, {n_ops} ops, num_blocks={trace['num_blocks']}, "
        f"built in {time.perf_counter() - t0:.1f}s"
    )
    if args.dump_trace:
        with open(args.dump_trace, "w") as f:
            json.dump(trace, f, separators=(",", ":"))
        print(f"wrote {args.dump_trace}")
        return

    runs = [
        replay(trace, "paged", trace["num_blocks"], args.max_model_len, args.sample_every)
        for _ in range(max(1, args.repeats))
    ]
    paged = runs[0]
    best = [min(r["step_ns"][i] for r in runs) for i in range(len(paged["step_ns"]))]
    # Steady state: skip step 0, the initial admission of the whole batch.
    us = [ns / 1000 for ns in best[1:]]
    single = [ns / 1000 for ns in paged["step_ns"][1:]]
    print(
        f"\nKV-manager work per step, {args.running} running (steps 1..{args.steps - 1}), "
        f"per-step minimum over {len(runs)} replays:"
    )
    print(
        f"  median {statistics.median(us):8.1f} us   p90 {percentile(us, 90):8.1f} us   "
        f"mean {statistics.fmean(us):8.1f} us   step 0 (batch admission) "
        f"{best[0] / 1000:.0f} us"
    )
    print(
        f"  (first replay alone: median {statistics.median(single):.1f} us, "
        f"p90 {percentile(single, 90):.1f} us)"
    )
    print(
        f"prefix-hit rate: {paged['hit_rate']:.1%} "
        f"({paged['hits']} of {paged['queries']} prompt tokens)"
    )

    rows = [("paged", args.block_size, paged)]
    if not args.no_reserve:
        per_req = math.ceil(args.max_model_len / args.block_size)
        reserve = replay(
            trace, "reserve", args.running * per_req + 1, args.max_model_len, args.sample_every
        )
        rows.append(("reserve", args.block_size, reserve))
    print(
        "\n| policy | block size | slots holding tokens / slots allocated (mean) | min | "
        "peak blocks in use |"
    )
    print("|---|---|---|---|---|")
    for name, bsz, res in rows:
        print(
            f"| {name} | {bsz} | {statistics.fmean(res['util']):.1%} | {min(res['util']):.1%} "
            f"| {res['peak_used']} |"
        )
    print(
        f"\npython {platform.python_version()}, {platform.machine()}, "
        f"{platform.processor() or 'cpu'}"
    )


if __name__ == "__main__":
    main()
