"""GPU check of the whole engine on one GPU (tp = 1): greedy parity with transformers, then
offline throughput.

Checkpoints (written to a temporary directory, removed at the end unless ``--keep``):
  demo  the built-in demo model (``write_demo_checkpoint``: Llama, hidden 256, 4 layers, vocab
        512, bf16 weights);
  1b    a random Llama of TinyLlama-1.1B shape (hidden 2048, 22 layers, 32 heads, 4 KV heads,
        intermediate 5632, vocab 32000; ~1.1B parameters), weights N(0, 0.02) seeded, norms 1,
        saved in bf16 with ``save_pretrained(safe_serialization=True)``, no tokenizer (every
        prompt here is token ids).

Phases:
1. Parity, bf16: for each checkpoint, 8 prompts of random token ids (16-512 tokens), 64 greedy
   tokens with ignore_eos, batched through ``LLM(backend="local", dtype="bfloat16")`` against
   transformers ``generate(do_sample=False)`` one prompt at a time (EOS disabled). bf16 may
   diverge: at a request's first differing token the report gives the transformers logits of
   both candidates (float32 of the bf16 output) and their gap, and the engine's own logprob gap.
   The run fails only if a request diverges at its first token with a gap > 0.5 (a real bug).
2. Parity, float32, demo model: must match token for token (TF32 off), else the run fails.
3. Throughput: the uniform workload of ``benchmarks/scripts/throughput.py`` (256 requests, random
   prompt ids, input and output lengths uniform in [100, 1024], ignore_eos) on the 1b model in
   bf16 with ``gpu_memory_utilization=0.85``: output and total tokens/s, steps, controller share,
   preemptions. A deadline (``--budget-s``) stops the run early if needed; the report says so.

Writes a markdown report to stdout (and to ``--out``, rewritten after each phase). Exit status
1 if a check fails or a phase raises. Sized for well under 5 minutes on one H200.

    python benchmarks/scripts/gpu_engine.py --out gpu_engine.md
    # smoke test:
    PAGEDSERVE_BACKEND=local python benchmarks/scripts/gpu_engine.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

T_START = time.perf_counter()
HERE = Path(__file__).resolve().parent

BUG_GAP = 0.5  # a first-token divergence with a larger logit gap is a real bug
NOISE_GAP = 0.1  # bf16 logits of a random model (|logit| ~ 1-5) carry ~1e-2..1e-1 of noise

ONE_B = {  # TinyLlama-1.1B shape
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
}
SMALL = {  # stands in for the 1b model in --quick mode
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="also write the markdown report to this path")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda (default), or cpu for a smoke test (float32 instead of bf16)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes: 4 prompts x 16 tokens, a small model for '1b', "
                        "32 requests of 16-128 tokens")
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="whole-script budget; the throughput run stops at it (default 240)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--max-output", type=int, default=None,
                   help="cap the throughput workload's output lengths (default: none)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--skip-parity", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--workdir", default=None, help="where to write the checkpoints (default: tmp)")
    p.add_argument("--keep", action="store_true", help="keep the written checkpoints")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def since_start() -> float:
    return time.perf_counter() - T_START


def log(msg: str) -> None:
    print(f"[{since_start():7.1f}s] {msg}", flush=True)


class Report:
    """Markdown lines, rewritten to ``--out`` after every phase (a killed run keeps its part)."""

    def __init__(self, out: str | None) -> None:
        self.out = out
        self.lines: list[str] = []
        self.failures: list[str] = []
        self.timings: list[tuple[str, float]] = []

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def fail(self, why: str) -> None:
        self.failures.append(why)
        log(f"FAIL: {why}")

    def text(self) -> str:
        body = list(self.lines)
        body += ["", "## Phase timings", "", "| phase | seconds |", "| --- | ---: |"]
        body += [f"| {name} | {secs:.1f} |" for name, secs in self.timings]
        body += [f"| total (script) | {since_start():.1f} |", "", "## Verdict", ""]
        if self.failures:
            body += ["**FAIL**", ""] + [f"- {f}" for f in self.failures]
        else:
            body += ["**PASS** (bf16 divergences, if any, are reported above and allowed)"]
        return "\n".join(body) + "\n"

    def flush(self) -> None:
        if self.out:
            Path(self.out).write_text(self.text())


# ------------------------------------------------------------------------------ environment


def free_memory(torch: Any) -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def gpu_mem(torch: Any) -> str:
    if not torch.cuda.is_available():
        return "n/a"
    return f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated"


def environment(torch: Any, args: argparse.Namespace) -> list[str]:
    import transformers

    rows = [
        ("python", sys.version.split()[0]),
        ("torch", torch.__version__),
        ("transformers", transformers.__version__),
        ("CUDA (torch build)", str(torch.version.cuda)),
        ("device arg", args.device),
    ]
    try:
        import triton

        rows.append(("triton", triton.__version__))
    except ImportError:
        rows.append(("triton", "not installed"))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        rows += [
            ("GPU", f"{props.name} (sm_{props.major}{props.minor}), "
                    f"{props.total_memory / 2**30:.1f} GiB, {torch.cuda.device_count()} visible"),
        ]
        m = torch.backends.cuda.matmul
        rows.append(("fp32 matmul", str(getattr(m, "fp32_precision", None)
                                         or f"allow_tf32={m.allow_tf32}")))
    try:
        rev = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(HERE), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        rows.append(("pagedserve commit", (rev or "?") + (" (dirty tree)" if dirty else "")))
    except (OSError, subprocess.SubprocessError):
        pass
    return ["| item | value |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in rows]


def disable_tf32(torch: Any) -> None:
    m = torch.backends.cuda.matmul
    if hasattr(m, "fp32_precision"):
        m.fp32_precision = "ieee"
    else:
        m.allow_tf32 = False
    cudnn = torch.backends.cudnn
    if hasattr(cudnn, "fp32_precision"):
        cudnn.fp32_precision = "ieee"
    else:
        cudnn.allow_tf32 = False


# ------------------------------------------------------------------------------ checkpoints


def write_random_llama(torch: Any, path: Path, shape: dict[str, int], device: str,
                       seed: int, std: float = 0.02) -> int:
    """A seeded random Llama in bf16 via ``save_pretrained``; returns the parameter count."""
    import transformers as tf

    config = tf.LlamaConfig(
        **shape,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=std,
    )
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path, safe_serialization=True)
    del model
    free_memory(torch)
    return n_params


# ------------------------------------------------------------------------------ parity


def make_prompts(np: Any, lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # ids 0-2 are pad/bos/eos in both checkpoints: keep prompts to ordinary tokens
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def engine_greedy(torch: Any, path: Path, prompts: list[list[int]], n_new: int, dtype: str,
                  max_model_len: int) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    from pagedserve import LLM, SamplingParams

    llm = LLM(str(path), backend="local", dtype=dtype, max_model_len=max_model_len,
              kv_cache_memory_bytes=1 << 30, max_num_seqs=len(prompts))
    try:
        sp = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True, logprobs=2)
        outs = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        llm.shutdown()
        del llm
        free_memory(torch)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [list(o.outputs[0].logprobs or []) for o in outs]
    return tokens, logprobs


def hf_greedy(torch: Any, path: Path, prompts: list[list[int]], n_new: int, dtype: Any,
              device: str, attn: str) -> tuple[list[list[int]], list[Any]]:
    """transformers greedy, one prompt at a time; also the float32 logits of every step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                 attn_implementation=attn)
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None  # fixed-length continuations
    model.generation_config.pad_token_id = 0
    tokens: list[list[int]] = []
    logits: list[Any] = []
    try:
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n_new,
                    do_sample=False,
                    pad_token_id=0,
                    return_dict_in_generate=True,
                    output_logits=True,
                )
            tokens.append(out.sequences[0, len(prompt):].tolist())
            logits.append(torch.stack([step[0] for step in out.logits]).float().cpu())
    finally:
        del model
        free_memory(torch)
    return tokens, logits


def compare(torch: Any, eng: list[int], eng_lp: list[dict[int, float]], hf: list[int],
            hf_logits: Any) -> dict[str, Any]:
    n = min(len(eng), len(hf))
    j = next((i for i in range(n) if eng[i] != hf[i]), None)
    if j is None and len(eng) == len(hf):
        return {"match": len(hf), "total": len(hf), "div": None}
    if j is None:  # one side is shorter (should not happen with ignore_eos)
        return {"match": n, "total": len(hf), "div": n, "short": True}
    row = hf_logits[j]
    h, e = hf[j], eng[j]
    top2 = torch.topk(row, 2)
    info: dict[str, Any] = {
        "match": j,
        "total": len(hf),
        "div": j,
        "hf_tok": h,
        "eng_tok": e,
        "hf_logit_hf": float(row[h]),
        "hf_logit_eng": float(row[e]),
        "gap": float(row[h] - row[e]),
        "hf_margin": float(top2.values[0] - top2.values[1]),
        "eng_gap": None,
    }
    if j < len(eng_lp) and e in eng_lp[j] and h in eng_lp[j]:
        info["eng_gap"] = float(eng_lp[j][e] - eng_lp[j][h])
    return info


def parity_phase(torch: Any, np: Any, rep: Report, name: str, path: Path, vocab: int,
                 lengths: list[int], n_new: int, engine_dtype: str, hf_dtype: Any,
                 device: str, exact: bool, seed: int) -> None:
    label = f"{name}, {engine_dtype}"
    log(f"parity [{label}]: {len(lengths)} prompts ({min(lengths)}-{max(lengths)} tokens), "
        f"{n_new} greedy tokens")
    prompts = make_prompts(np, lengths, vocab, seed)
    t0 = time.perf_counter()
    eng, eng_lp = engine_greedy(torch, path, prompts, n_new, engine_dtype,
                                max_model_len=max(lengths) + n_new + 16)
    t_eng = time.perf_counter() - t0
    log(f"  engine done in {t_eng:.1f}s ({gpu_mem(torch)} after freeing)")
    attn = "eager" if exact else "sdpa"
    t0 = time.perf_counter()
    hf, hf_logits = hf_greedy(torch, path, prompts, n_new, hf_dtype, device, attn)
    t_hf = time.perf_counter() - t0
    log(f"  transformers ({attn}) done in {t_hf:.1f}s ({gpu_mem(torch)} after freeing)")

    rows = [compare(torch, e, lp, h, lg) for e, lp, h, lg in zip(eng, eng_lp, hf, hf_logits,
                                                                  strict=True)]
    rep.add("", f"### Parity: {label} (engine batched vs transformers one by one, "
                f"transformers attention: {attn})", "",
            f"engine {t_eng:.1f}s, transformers {t_hf:.1f}s. `gap` = transformers logit of its "
            "own token minus that of the engine's token at the first differing position "
            "(same context on both sides up to there); `engine gap` = the engine's logprob of "
            "its token minus that of transformers' token (from its top-2); `hf margin` = "
            "transformers' own top-1 minus top-2 logit there.", "",
            "| prompt len | equal before first divergence | first divergence | tokens hf / engine "
            "| hf logits (hf tok / eng tok) | gap | engine gap | hf margin | verdict |",
            "| ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | --- |")
    n_exact = 0
    for plen, r in zip(lengths, rows, strict=True):
        if r["div"] is None:
            n_exact += 1
            rep.add(f"| {plen} | {r['match']}/{r['total']} | - | - | - | - | - | - | exact |")
            continue
        if r.get("short"):
            verdict = "length mismatch"
            rep.add(f"| {plen} | {r['match']}/{r['total']} | {r['div']} | - | - | - | - | - "
                    f"| {verdict} |")
            rep.fail(f"{label}: prompt of {plen} tokens: outputs of different lengths")
            continue
        gap = r["gap"]
        if exact:
            verdict = "MISMATCH (float32 must be exact)"
        elif r["div"] == 0 and gap > BUG_GAP:
            verdict = f"BUG: first token, gap > {BUG_GAP}"
        elif gap <= NOISE_GAP:
            verdict = "bf16 near-tie"
        elif gap <= BUG_GAP:
            verdict = "bf16 drift (gap within 0.5)"
        else:
            verdict = f"suspicious (gap > {BUG_GAP}, after {r['div']} equal tokens)"
        eng_gap = "-" if r["eng_gap"] is None else f"{r['eng_gap']:.4f}"
        rep.add(f"| {plen} | {r['match']}/{r['total']} | {r['div']} | {r['hf_tok']} / "
                f"{r['eng_tok']} | {r['hf_logit_hf']:.4f} / {r['hf_logit_eng']:.4f} | "
                f"{gap:.4f} | {eng_gap} | {r['hf_margin']:.4f} | {verdict} |")
        if exact:
            rep.fail(f"{label}: prompt of {plen} tokens diverges at token {r['div']} "
                     f"(gap {gap:.2e})")
        elif r["div"] == 0 and gap > BUG_GAP:
            rep.fail(f"{label}: prompt of {plen} tokens diverges at its first token with "
                     f"logit gap {gap:.3f} > {BUG_GAP}")
    equal = sum(r["match"] for r in rows)
    total = sum(r["total"] for r in rows)
    rep.add("", f"Summary: {n_exact}/{len(rows)} prompts identical; {equal}/{total} tokens equal "
                "before the first divergence.")
    log(f"  {n_exact}/{len(rows)} prompts identical, {equal}/{total} tokens before divergence")


# ------------------------------------------------------------------------------ throughput


def throughput_phase(torch: Any, np: Any, rep: Report, args: argparse.Namespace, path: Path,
                     model_name: str, dtype: str, n: int, lo: int, hi: int,
                     deadline: float) -> None:
    from pagedserve import LLM, SamplingParams
    from pagedserve.messages import AddRequest

    sys.path.insert(0, str(HERE))
    from throughput import uniform_workload  # the workload of benchmarks/scripts/throughput.py

    opts: dict[str, Any] = {
        "dtype": dtype,
        "max_model_len": 2 * hi,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    if args.device == "cuda":
        opts["gpu_memory_utilization"] = 0.85
    t0 = time.perf_counter()
    llm = LLM(str(path), backend="local", **opts)
    t_load = time.perf_counter() - t0
    try:
        stats0 = llm.stats()
        log(f"  engine up in {t_load:.1f}s: {stats0['kv_blocks_total']} KV blocks, "
            f"{stats0['kv_capacity_tokens']} tokens of KV ({gpu_mem(torch)})")
        vocab = llm.vocab_size
        rng = np.random.default_rng(args.seed)
        prompts, outs = uniform_workload(rng, n, lo, hi, vocab)
        if args.max_output is not None:
            outs = [min(o, args.max_output) for o in outs]
        params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outs]

        # Warm-up: compile the kernel variants of prefill, mixed and decode batches.
        t0 = time.perf_counter()
        warm = [rng.integers(0, vocab, size=int(k)).tolist()
                for k in rng.integers(lo, hi + 1, size=min(32, n))]
        llm.generate(warm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
        t_warm = time.perf_counter() - t0
        log(f"  warm-up {t_warm:.1f}s; timed run: {n} requests, "
            f"{sum(len(p) for p in prompts)} prompt + {sum(outs)} output tokens, "
            f"deadline in {deadline - time.perf_counter():.0f}s")

        client = llm.client
        assert client is not None
        before = llm.stats()
        t0 = time.perf_counter()
        ids = [f"tp-{i}" for i in range(n)]
        produced: dict[str, int] = {}
        finished: set[str] = set()
        errors: list[str] = []

        def sink(delta: Any) -> None:  # runs on the client's thread
            if delta.error is not None:
                errors.append(f"request {delta.request_id} failed: {delta.error}")
            produced[delta.request_id] = produced.get(delta.request_id, 0) + sum(
                len(c.token_ids) for c in delta.completions)
            if delta.finished:
                finished.add(delta.request_id)

        futs = [client.submit(AddRequest(rid, prompt, sp), sink)
                for rid, prompt, sp in zip(ids, prompts, params, strict=True)]
        for fut in futs:
            client.wait_added(fut)
        stopped_early = False
        next_note = t0 + 15.0
        while len(finished) < n:
            time.sleep(0.01)
            if errors:
                raise RuntimeError(errors[0])
            now = time.perf_counter()
            if now > next_note:
                log(f"  ... {len(finished)}/{n} finished, {sum(produced.values())} tokens out")
                next_note = now + 15.0
            if now > deadline and len(finished) < n:
                stopped_early = True
                break
        elapsed = time.perf_counter() - t0
        after = llm.stats()
        if stopped_early:
            for rid in ids:
                if rid not in finished:
                    client.abort_request(rid)
    finally:
        llm.shutdown()
        del llm
        free_memory(torch)

    out_tokens = sum(produced.values())
    if stopped_early:
        done = [i for i, rid in enumerate(ids) if rid in finished]
        in_tokens = sum(len(prompts[i]) for i in range(n) if ids[i] in produced)
    else:
        done = list(range(n))
        in_tokens = sum(len(p) for p in prompts)
        if out_tokens != sum(outs):
            rep.fail(f"throughput: {out_tokens} output tokens, expected {sum(outs)}")
    sched = after["time_schedule_s"] - before["time_schedule_s"]
    execute = after["time_execute_s"] - before["time_execute_s"]
    steps = after["num_steps"] - before["num_steps"]
    preempt = after["num_preemptions"] - before["num_preemptions"]
    cap = "none" if args.max_output is None else str(args.max_output)
    rep.add("", f"### Throughput: uniform workload, {model_name} model", "",
            f"{n} requests, random prompt token ids, input and output lengths uniform in "
            f"[{lo}, {hi}] (output cap: {cap}), ignore_eos, greedy; dtype {dtype}; "
            f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
            f"{args.max_num_batched_tokens}, "
            + ("gpu_memory_utilization 0.85" if args.device == "cuda" else "CPU KV budget 1 GiB")
            + f"; KV pool {after['kv_blocks_total']} blocks = {after['kv_capacity_tokens']} "
              f"tokens. Engine start {t_load:.1f}s, warm-up {t_warm:.1f}s (not timed).", "")
    if stopped_early:
        rep.add(f"**Stopped at the deadline** (`--budget-s {args.budget_s:.0f}`) with "
                f"{len(done)}/{n} requests finished: the figures cover the run so far, which "
                "had more requests in flight than its tail would (optimistic). Rerun with "
                "`--max-output 512` or fewer `--num-requests` for a complete run.", "")
    rep.add("| metric | value |", "| --- | ---: |",
            f"| wall time (s) | {elapsed:.2f} |",
            f"| output tokens | {out_tokens} |",
            f"| prompt tokens | {in_tokens} |",
            f"| **output tokens/s** | **{out_tokens / elapsed:.1f}** |",
            f"| total tokens/s | {(in_tokens + out_tokens) / elapsed:.1f} |",
            f"| requests/s | {len(done) / elapsed:.3f} |",
            f"| steps | {steps} |",
            f"| controller ms/step (schedule + bookkeeping) | {1e3 * sched / max(steps, 1):.3f} |",
            f"| worker ms/step (execute) | {1e3 * execute / max(steps, 1):.3f} |",
            f"| controller share | {sched / max(sched + execute, 1e-9):.1%} |",
            f"| preemptions | {preempt} |")
    log(f"  {out_tokens} output tokens in {elapsed:.1f}s = {out_tokens / elapsed:.1f} tok/s "
        f"(total {(in_tokens + out_tokens) / elapsed:.1f} tok/s), {steps} steps, "
        f"controller share {sched / max(sched + execute, 1e-9):.1%}, {preempt} preemptions"
        + (" [stopped at deadline]" if stopped_early else ""))


# ------------------------------------------------------------------------------ main


def run_phase(rep: Report, name: str, fn: Any, *a: Any, **kw: Any) -> bool:
    t0 = time.perf_counter()
    ok = True
    try:
        fn(*a, **kw)
    except Exception as exc:  # report and carry on with the next phase
        ok = False
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        rep.add("", f"### {name}: ERROR", "", "```", tb.rstrip()[-3000:], "```")
        rep.fail(f"{name} raised {type(exc).__name__}: {exc}")
    secs = time.perf_counter() - t0
    rep.timings.append((name, secs))
    log(f"phase '{name}' took {secs:.1f}s")
    rep.flush()
    return ok


def ensure_importable() -> None:
    """``import pagedserve`` even where the project is not installed: the repository root is the
    package itself, so put a ``pagedserve`` link to it on ``sys.path``."""
    try:
        import pagedserve  # noqa: F401
    except ImportError:
        shim = Path(tempfile.mkdtemp(prefix="pagedserve-shim-"))
        (shim / "pagedserve").symlink_to(HERE.parent, target_is_directory=True)
        sys.path.insert(0, str(shim))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the engine's worker takes a GPU when it sees one
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ensure_importable()

    import numpy as np
    import torch
    import transformers

    from pagedserve.workers.demo import DEMO_VOCAB_SIZE, write_demo_checkpoint

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: use --device cpu for the smoke test", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    device = args.device
    cuda = device == "cuda"
    deadline_abs = T_START + args.budget_s - 10.0  # leave room for shutdown and cleanup

    if args.quick:
        lengths, n_new = [16, 24, 40, 64], 16
        big_shape, big_name = SMALL, "small (stands in for 1b: --quick)"
        n_req, lo, hi = 32, 16, 128
    else:
        lengths, n_new = [16, 48, 96, 160, 224, 300, 400, 512], 64
        big_shape, big_name = ONE_B, "1b"
        n_req, lo, hi = 256, 100, 1024
    if args.num_requests is not None:
        n_req = args.num_requests
    low_dtype = "bfloat16" if cuda else "float32"
    low_torch = torch.bfloat16 if cuda else torch.float32
    if cuda:
        disable_tf32(torch)

    rep = Report(args.out)
    rep.add("# pagedserve engine on one GPU (tp = 1): parity with transformers, throughput", "",
            f"`{' '.join([Path(sys.argv[0]).name] + sys.argv[1:])}`", "", "## Environment", "")
    rep.add(*environment(torch, args))
    if not cuda:
        rep.add("", "CPU smoke run: the 'bf16' phases run in float32 (no bf16 on CPU here).")
    rep.flush()
    print("\n".join(rep.lines), flush=True)

    work = Path(tempfile.mkdtemp(prefix="pagedserve-gpu-engine-", dir=args.workdir))
    demo_dir, big_dir = work / "demo", work / "big"
    log(f"checkpoints under {work}")
    info: dict[str, Any] = {}
    try:
        def write_checkpoints() -> None:
            write_demo_checkpoint(demo_dir)
            info["params"] = write_random_llama(torch, big_dir, big_shape, device, args.seed)
            size = sum(f.stat().st_size for f in big_dir.glob("*.safetensors"))
            rep.add("", "## Checkpoints", "",
                    "- demo: `write_demo_checkpoint` (Llama, hidden 256, 4 layers, 4 heads / "
                    "2 KV heads, vocab 512, bf16 weights)",
                    f"- {big_name}: random Llama {big_shape}, N(0, 0.02) seeded, norms 1, "
                    f"{info['params'] / 1e9:.3f}B parameters, {size / 2**30:.2f} GiB bf16 "
                    "safetensors, no tokenizer (token-id prompts)")
            log(f"checkpoints written: {big_name} has {info['params'] / 1e9:.3f}B parameters")

        if not run_phase(rep, "write checkpoints", write_checkpoints):
            return finish(rep, work, args)

        if not args.skip_parity:
            rep.add("", "## Greedy parity", "",
                    f"Failure rules: float32 must be token-exact; in {low_dtype}, a divergence "
                    f"at the first generated token with a logit gap > {BUG_GAP} is a bug. "
                    f"Verdict labels: near-tie (gap <= {NOISE_GAP}), drift (gap <= {BUG_GAP}).")
            run_phase(rep, f"parity demo {low_dtype}", parity_phase, torch, np, rep, "demo",
                      demo_dir, DEMO_VOCAB_SIZE, lengths, n_new, low_dtype, low_torch, device,
                      exact=not cuda, seed=args.seed)
            run_phase(rep, f"parity {big_name.split()[0]} {low_dtype}", parity_phase, torch, np,
                      rep, big_name.split()[0], big_dir, big_shape["vocab_size"], lengths, n_new,
                      low_dtype, low_torch, device, exact=not cuda, seed=args.seed + 1)
            run_phase(rep, "parity demo float32 (exact check)", parity_phase, torch, np, rep,
                      "demo", demo_dir, DEMO_VOCAB_SIZE, lengths, n_new, "float32", torch.float32,
                      device, exact=True, seed=args.seed + 2)

        if not args.skip_throughput:
            rep.add("", "## Throughput")
            log(f"throughput: {n_req} requests, lengths {lo}-{hi}, model {big_name}")
            run_phase(rep, "throughput", throughput_phase, torch, np, rep, args, big_dir,
                      big_name, low_dtype, n_req, lo, hi, deadline_abs)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return finish(rep, work, args)


def finish(rep: Report, work: Path, args: argparse.Namespace) -> int:
    if args.keep:
        rep.add("", f"Checkpoints kept under `{work}`.")
    rep.flush()
    print("\n" + "=" * 80 + "\n" + rep.text(), flush=True)
    if args.out:
        log(f"report written to {args.out}")
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())
