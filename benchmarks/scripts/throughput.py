"""Offline throughput: output tokens/s and requests/s of ``LLM.generate`` on a whole batch.

Workloads:
  uniform   the nano-vllm / mini-sglang one: 256 requests, random prompt token ids, input and
            output lengths uniform in [100, 1024], ignore_eos.
  sharegpt  ShareGPT-like log-normal lengths, clipped to the model length, ignore_eos.

Also prints the controller's share of each step (scheduling + bookkeeping against the worker's
forward pass), from the engine's own counters.

    python benchmarks/scripts/throughput.py --quick                 # this 2-core CPU machine
    python benchmarks/scripts/throughput.py --model DIR --workload sharegpt
    python benchmarks/scripts/throughput.py --quick --backend local --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pagedserve import LLM, SamplingParams


def uniform_workload(rng: np.random.Generator, n: int, lo: int, hi: int, vocab: int):
    ins = rng.integers(lo, hi + 1, size=n)
    outs = rng.integers(lo, hi + 1, size=n)
    prompts = [rng.integers(0, vocab, size=int(k)).tolist() for k in ins]
    return prompts, [int(o) for o in outs]


def sharegpt_workload(rng: np.random.Generator, n: int, max_len: int, vocab: int, scale: float):
    # Log-normal fits of ShareGPT conversation lengths (input mean ~ 160, output mean ~ 340).
    ins = np.clip(rng.lognormal(4.6, 0.9, size=n) * scale, 4, max_len // 2).astype(int)
    outs = np.clip(rng.lognormal(5.4, 0.8, size=n) * scale, 4, max_len // 2).astype(int)
    prompts = [rng.integers(0, vocab, size=int(k)).tolist() for k in ins]
    return prompts, [int(o) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo", help="checkpoint dir or .gguf file (default: demo)")
    ap.add_argument("--workload", choices=["uniform", "sharegpt"], default="uniform")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="32 requests, lengths 16-128")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto",
                    help="model dtype: auto (the checkpoint's where the device computes it fast), "
                         "float32, bfloat16, float16")
    ap.add_argument("--quantization", default="auto",
                    help="auto (a GGUF file's blocks), none, int8 or gguf, as LLM() takes it")
    ap.add_argument("--backend", choices=["ray", "local"], default=None,
                    help="ray (the default path: controller and worker actors) or local "
                         "(the engine in this process)")
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.min_len, args.max_len = 32, 16, 128

    llm = LLM(
        args.model,
        backend=args.backend,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        dtype=args.dtype,
        quantization=args.quantization,
    )
    vocab = llm.vocab_size
    rng = np.random.default_rng(args.seed)
    if args.workload == "uniform":
        prompts, outs = uniform_workload(rng, args.num_requests, args.min_len, args.max_len, vocab)
    else:
        scale = args.max_len / 1024
        prompts, outs = sharegpt_workload(rng, args.num_requests, 2 * args.max_len, vocab, scale)
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outs]

    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    before = llm.stats()
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    after = llm.stats()
    llm.shutdown()

    out_tokens = sum(len(c.token_ids) for r in results for c in r.outputs)
    in_tokens = sum(len(p) for p in prompts)
    assert out_tokens == sum(outs), "every request must produce exactly max_tokens tokens"
    sched = after["time_schedule_s"] - before["time_schedule_s"]
    execute = after["time_execute_s"] - before["time_execute_s"]
    steps = after["num_steps"] - before["num_steps"]
    print(f"backend={args.backend or 'ray'} dtype={args.dtype} "
          f"quantization={args.quantization} workload={args.workload} "
          f"requests={len(prompts)} input_tokens={in_tokens} output_tokens={out_tokens}")
    print(f"elapsed_s={elapsed:.2f} output_tok_per_s={out_tokens / elapsed:.1f} "
          f"total_tok_per_s={(in_tokens + out_tokens) / elapsed:.1f} "
          f"req_per_s={len(prompts) / elapsed:.3f}")
    print(f"steps={steps} controller_ms_per_step={1e3 * sched / max(steps, 1):.3f} "
          f"worker_ms_per_step={1e3 * execute / max(steps, 1):.3f} "
          f"controller_share={sched / max(sched + execute, 1e-9):.1%} "
          f"preemptions={after['num_preemptions'] - before['num_preemptions']}")


if __name__ == "__main__":
    main()
