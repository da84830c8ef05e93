"""Side by side: pagedserve against its peers on one workload, one checkpoint, one machine.

Engines (each runs in a fresh subprocess per round; only its ``generate`` call is timed, after a
warm-up, so start-up and model loading are left out):

  pagedserve        ``LLM()`` with its defaults: the Ray path (controller and worker actors)
  pagedserve-local  the engine in the benchmark's process (``backend="local"``)
  pagedserve-sync   ``LLM()`` with ``async_scheduling=False``: each step scheduled after the one
                    before is back, to set async scheduling beside the default
  pagedserve-1pass  ``LLM()`` with ``num_scheduler_steps=1``: one decode pass per step message
                    (several run only while at most four requests remain)
  pagedserve-int8   ``LLM()`` with ``quantization="int8"`` (whatever ``--quantization`` says):
                    int8 weights and activations beside the engine at ``--dtype``
  pagedserve-fp8kv  ``LLM()`` with an fp8 KV cache (``kv_cache_dtype="fp8_e4m3"``, scales from the
                    first prefill): half a bf16 model's KV bytes
  pagedserve-int8-fp8kv  both: int8 weights and an fp8 KV cache
  pagedserve-local-int8  the in-process engine with int8 weights, beside pagedserve-local
  pagedserve-spec   ``LLM()`` with ``--speculative-config`` (default: prompt lookup), to set
                    speculative decoding beside the same engine without it
  hf-static         Hugging Face ``generate`` on static batches (left padding, batch = the
                    ``--hf-batch-size`` requests in arrival order, each batch runs until its
                    longest request is done; only each request's own tokens count)
  hf-cb             transformers' continuous batching (``generate_batch``'s manager, one
                    ``max_new_tokens`` per request)
  vllm              vLLM's CPU build, when ``--vllm-venv`` names a virtual environment holding it
                    (run from a working directory outside this repository, whose top-level
                    folders would shadow modules), its worker bound to every core
                    (``VLLM_CPU_OMP_THREADS_BIND=0-N``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``): its
                    best here, since by default it keeps a core for its engine process
  vllm-default      the same at vLLM's default binding, reported beside it
  base, base-local  pagedserve (default path, in-process) from ``--baseline-venv``, a virtual
                    environment with another checkout installed: the A/B of one change

Workload: random prompt token ids, input and output lengths uniform in the given ranges, greedy,
``ignore_eos``, every engine at ``--dtype`` (float32 or bfloat16). The engines alternate over
rounds (the order reverses every round), and each ratio is taken within a round, so the
machine's drift cancels. The greedy outputs of every engine are compared token for token with
Hugging Face's static batching. Below the table, each pagedserve engine's CPU seconds over its
timed call, by process (``proc_cpu.py``): the worker, the controller, the client and Ray's own
services.

How far from the machine's limit: each engine's model FLOP/s (2 x the linear layers' weights per
token, prompt and output tokens alike; attention left out, so it is a floor) as a share of this
machine's GEMM peak at that dtype, measured by a short matmul probe in this same run.

    python benchmarks/scripts/peers.py --quick                                   # CI: a few seconds
    python benchmarks/scripts/peers.py --model demo --vllm-venv /path/to/vllm-venv --rounds 3
    python benchmarks/scripts/peers.py --model llama-22m ... --out docs/results/peers-22m.md

``--model`` is ``demo`` (random Llama, hidden 256 x 4 layers), ``llama-22m`` (random Llama, hidden
512 x 8 layers, written on first use), ``smollm2`` (the default real model) or a checkpoint dir.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from proc_cpu import ROLES, cpu_by_role, cpu_seconds  # beside this script

from pagedserve.benchmarks.report import emit_table
from pagedserve.config import cache_root

HERE = Path(__file__).resolve().parent
ENGINES = ("pagedserve", "pagedserve-local", "pagedserve-sync", "pagedserve-1pass",
           "pagedserve-int8", "pagedserve-fp8kv", "pagedserve-int8-fp8kv", "pagedserve-local-int8",
           "pagedserve-spec", "hf-static", "hf-cb", "vllm", "vllm-default", "base", "base-local")
VLLM_ENGINES = ("vllm", "vllm-default")
REFERENCE = "hf-static"


# -- checkpoints and workload --------------------------------------------------------------------

def llama_22m_dir() -> Path:
    """A random Llama with hidden 512 x 8 layers (22M parameters), written once into the cache."""
    target = cache_root() / "bench-llama-22m"
    if (target / "model.safetensors").exists():
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedserve.workers.demo import DEMO_VOCAB_SIZE, write_tokenizer

    torch.manual_seed(22)
    cfg = LlamaConfig(vocab_size=DEMO_VOCAB_SIZE, hidden_size=512, intermediate_size=1024,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=64, max_position_embeddings=2048, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    tmp = Path(tempfile.mkdtemp(prefix=".bench-llama-22m-", dir=target.parent))
    LlamaForCausalLM(cfg).save_pretrained(tmp)
    write_tokenizer(tmp, cfg.max_position_embeddings)
    tmp.rename(target)
    return target


def model_dir(name: str) -> Path:
    from pagedserve.builder import resolve_model_dir

    if name == "llama-22m":
        return llama_22m_dir()
    return Path(resolve_model_dir(None if name == "smollm2" else name))


def make_workload(n: int, in_range: tuple[int, int], out_range: tuple[int, int], vocab: int,
                  seed: int) -> dict[str, list]:
    import numpy as np

    rng = np.random.default_rng(seed)
    ins = rng.integers(in_range[0], in_range[1] + 1, size=n)
    outs = rng.integers(out_range[0], out_range[1] + 1, size=n)
    # Ids 0-2 are pad/bos/eos in the random checkpoints; keep prompts clear of them.
    prompts = [rng.integers(3, vocab, size=int(k)).tolist() for k in ins]
    return {"prompts": prompts, "max_tokens": [int(o) for o in outs]}


# -- one engine, in its own process -------------------------------------------------------------

def run_pagedserve(model: str, work: dict, backend: str | None, dtype: str,
                   quantization: str, **options: Any) -> list[list[int]]:
    from pagedserve import LLM, SamplingParams

    llm = LLM(model, backend=backend, dtype=dtype, quantization=quantization, **options)
    try:
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                  for m in work["max_tokens"]]
        llm.generate(work["prompts"][:4], params[:4], use_tqdm=False)  # warm-up
        cpu0 = cpu_seconds()
        t0 = time.perf_counter()
        outs = llm.generate(work["prompts"], params, use_tqdm=False)
        work["elapsed_s"] = time.perf_counter() - t0
        work["cpu_s"] = cpu_by_role(cpu0, cpu_seconds())
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def _hf_model(model: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    m.generation_config.eos_token_id = None  # ignore_eos
    m.generation_config.pad_token_id = 0
    return m.eval()


def run_hf_static(model: str, work: dict, batch_size: int, dtype: str) -> list[list[int]]:
    import torch

    m = _hf_model(model, dtype)
    prompts, max_tokens = work["prompts"], work["max_tokens"]

    def batch(idx: list[int]) -> list[list[int]]:
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):  # left padding
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        new = max(max_tokens[i] for i in idx)
        with torch.inference_mode():
            out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False)
        return [out[row, width: width + max_tokens[i]].tolist() for row, i in enumerate(idx)]

    batch([0])  # warm-up
    t0 = time.perf_counter()
    result: list[list[int]] = []
    for s in range(0, len(prompts), batch_size):
        result.extend(batch(list(range(s, min(s + batch_size, len(prompts))))))
    work["elapsed_s"] = time.perf_counter() - t0
    return result


def run_hf_cb(model: str, work: dict, dtype: str) -> list[list[int]]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    m = _hf_model(model, dtype)
    prompts, max_tokens = work["prompts"], work["max_tokens"]
    gen = GenerationConfig(max_new_tokens=max(max_tokens), do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    # Sized for the workload: its defaults (256-token pages, a cache sized from GPU memory) make
    # every CPU step pad to thousands of slots and run many times slower.
    page = 32
    blocks = sum(-(-(len(p) + o) // page) for p, o in zip(prompts, max_tokens, strict=True))
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=blocks + len(prompts),
                                  max_batch_tokens=2048, max_requests_per_batch=len(prompts))

    def run(idx: list[int]) -> dict[int, list[int]]:
        done: dict[int, list[int]] = {}
        with m.continuous_batching_context_manager(generation_config=gen,
                                                   continuous_batching_config=cb, block=True,
                                                   timeout=5, warmup=False) as manager:
            rid_of = {manager.add_request(prompts[i], request_id=f"r{i}",
                                          max_new_tokens=max_tokens[i]): i for i in idx}
            while len(done) < len(idx):
                res = manager.get_result(timeout=1)
                if res is not None and res.is_finished():
                    done[rid_of[res.request_id]] = list(res.generated_tokens)
        return done

    run([0])  # warm-up
    t0 = time.perf_counter()
    done = run(list(range(len(prompts))))
    work["elapsed_s"] = time.perf_counter() - t0
    return [done[i] for i in range(len(prompts))]


def run_one(args: argparse.Namespace) -> None:
    work = json.loads(Path(args.workload).read_text())
    if args.run_one in ("pagedserve", "base"):
        outs = run_pagedserve(args.model_dir, work, None, args.dtype, args.quantization)
    elif args.run_one in ("pagedserve-int8", "pagedserve-local-int8"):
        backend = "local" if args.run_one == "pagedserve-local-int8" else None
        outs = run_pagedserve(args.model_dir, work, backend, args.dtype, "int8")
    elif args.run_one in ("pagedserve-fp8kv", "pagedserve-int8-fp8kv"):
        quantization = "int8" if args.run_one == "pagedserve-int8-fp8kv" else args.quantization
        outs = run_pagedserve(args.model_dir, work, None, args.dtype, quantization,
                              kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True)
    elif args.run_one == "pagedserve-spec":
        outs = run_pagedserve(args.model_dir, work, None, args.dtype, args.quantization,
                              speculative_config=json.loads(args.speculative_config))
    elif args.run_one == "pagedserve-sync":
        outs = run_pagedserve(args.model_dir, work, None, args.dtype, args.quantization,
                              async_scheduling=False)
    elif args.run_one == "pagedserve-1pass":
        outs = run_pagedserve(args.model_dir, work, None, args.dtype, args.quantization,
                              num_scheduler_steps=1)
    elif args.run_one in ("pagedserve-local", "base-local"):
        outs = run_pagedserve(args.model_dir, work, "local", args.dtype, args.quantization)
    elif args.run_one == "hf-static":
        outs = run_hf_static(args.model_dir, work, args.hf_batch_size, args.dtype)
    else:
        outs = run_hf_cb(args.model_dir, work, args.dtype)
    Path(args.result).write_text(json.dumps({"elapsed_s": work["elapsed_s"], "outputs": outs,
                                             "cpu_s": work.get("cpu_s")}))


# -- the driver ---------------------------------------------------------------------------------

def launch(engine: str, args: argparse.Namespace, mdir: Path, wfile: Path, tmp: Path) -> dict:
    result = tmp / f"{engine}.json"
    result.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": ""}
    if engine in VLLM_ENGINES:
        py = Path(args.vllm_venv) / "bin" / "python"
        cmd = [str(py), str(HERE / "peers" / "vllm_generate.py")]
        if engine == "vllm":  # every core to its worker: nothing kept back for the engine core
            env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
                    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        else:
            for key in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
                env.pop(key, None)
    else:
        py = Path(args.baseline_venv) / "bin" / "python" if engine.startswith("base") else None
        cmd = [str(py or sys.executable), str(Path(__file__).resolve()), "--run-one", engine,
               "--hf-batch-size", str(args.hf_batch_size), "--quantization", args.quantization,
               "--speculative-config", args.speculative_config]
    cmd += ["--model-dir", str(mdir), "--workload", str(wfile), "--result", str(result),
            "--dtype", args.dtype]
    # A working directory outside the repository: its top-level folders shadow other modules.
    subprocess.run(cmd, cwd=tmp, check=True, stdout=subprocess.DEVNULL if args.quiet else None,
                   env=env)
    return json.loads(result.read_text())


def agreement(outs: list[list[int]], ref: list[list[int]]) -> tuple[int, float]:
    """(requests identical to the reference, mean share of tokens before the first difference)."""
    same, share = 0, 0.0
    for a, b in zip(outs, ref, strict=True):
        same += a == b
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))
        share += n / max(len(b), 1)
    return same, share / max(len(ref), 1)


def linear_flops_per_token(mdir: Path) -> int:
    """2 x the weights of the model's linear layers (the LM head included, tied or not): the
    matmul FLOPs one token costs, attention left out."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(mdir))
    return 2 * sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, torch.nn.Linear))


def gemm_peak_flops(mdir: Path, dtype: str) -> float:
    """The best FLOP/s of a matmul on the model's widest MLP shape (256 rows, as a prefill
    chunk), all cores, at ``dtype``: what this machine's matmuls reach, for the share column.
    The best of ``F.linear`` (MKL at float32), oneDNN's linear on a weight packed once (what
    vLLM runs on the CPU) and pagedserve's tiled kernel where it is built, each the fastest of
    20 timed rounds: one library alone, or a few calls, read below what the engines reach (at
    float32, ``F.linear`` alone read half the packed matmul's rate on one run)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig

    from pagedserve.kernels.linear import is_tiled, linear, pack_weight

    cfg = AutoConfig.from_pretrained(mdir)
    dt = getattr(torch, dtype)
    x = torch.randn(256, cfg.hidden_size, dtype=dt)
    w = torch.randn(cfg.intermediate_size, cfg.hidden_size, dtype=dt)
    calls = [lambda: F.linear(x, w)]
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        calls.append(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    except (AttributeError, RuntimeError):  # a torch build without oneDNN's linear
        pass
    tiled = pack_weight(w)
    if tiled is not None and is_tiled(tiled):
        calls.append(lambda: linear(x, None, tiled))
    flops = 2 * x.shape[0] * w.shape[0] * w.shape[1]
    best = float("inf")
    with torch.inference_mode():
        for call in calls:
            for _ in range(3):
                call()
            for _ in range(20):
                t0 = time.perf_counter()
                for _ in range(10):
                    call()
                best = min(best, (time.perf_counter() - t0) / 10)
    return flops / best


def report(args: argparse.Namespace, engines: list[str], rounds: list[dict[str, dict]],
           work: dict, flops_per_token: int, peak: float) -> str:
    tokens = sum(work["max_tokens"])
    processed = tokens + sum(len(p) for p in work["prompts"])
    base = "vllm" if "vllm" in engines else engines[0]
    lines = [f"model `{args.model}`, {len(work['prompts'])} requests, input "
             f"{args.input_len[0]}-{args.input_len[1]}, output {args.output_len[0]}-"
             f"{args.output_len[1]} tokens ({tokens} in all), greedy, ignore_eos, {args.dtype}, "
             f"{len(rounds)} round(s), torch threads {os.cpu_count()} cores; GEMM peak "
             f"{peak / 1e9:.1f} GFLOP/s at {args.dtype}, {flops_per_token / 1e6:.1f} MFLOP per "
             "token in the linear layers", "",
             f"| engine | output tok/s (median) | per round | ratio to {base} (median) "
             f"| model FLOP/s, share of GEMM peak | identical to {REFERENCE} "
             "| tokens before first difference |",
             "|---|---|---|---|---|---|---|"]
    ref = rounds[0].get(REFERENCE)
    for e in engines:
        tps = [tokens / r[e]["elapsed_s"] for r in rounds]
        ratios = [r[base]["elapsed_s"] / r[e]["elapsed_s"] for r in rounds]
        fps = processed * flops_per_token / statistics.median(r[e]["elapsed_s"] for r in rounds)
        agree, prefix = "-", "-"
        if ref:
            same, share = agreement(rounds[0][e]["outputs"], ref["outputs"])
            agree, prefix = f"{same}/{len(work['prompts'])}", f"{share:.1%}"
        lines.append(f"| {e} | {statistics.median(tps):.1f} | "
                     f"{', '.join(f'{t:.1f}' for t in tps)} | {statistics.median(ratios):.2f}x | "
                     f"{fps / 1e9:.1f} G, {fps / peak:.0%} | {agree} | {prefix} |")
    # Where the CPU went (pagedserve engines, from /proc over the timed call; medians).
    cpu = [(e, [r[e]["cpu_s"] for r in rounds]) for e in engines if rounds[0][e].get("cpu_s")]
    if cpu:
        lines += ["", "CPU seconds over the timed call (median), by process: worker, "
                  "controller, client (the whole engine when in-process), Ray services"]
        lines += [f"- {e}: " + ", ".join(f"{statistics.median(c[role] for c in cs):.2f}"
                                         for role in ROLES) for e, cs in cpu]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--engines", default="pagedserve,pagedserve-local,hf-static,hf-cb",
                    help="comma-separated; vllm (base, base-local) is added when --vllm-venv "
                         "(--baseline-venv) is given")
    ap.add_argument("--vllm-venv", default=None,
                    help="adds vllm (worker bound to every core) and vllm-default (its default "
                         "binding)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="every engine's weights and activations")
    ap.add_argument("--quantization", default="none",
                    help="pagedserve's quantization; none (the default) serves the checkpoint's "
                         "own weights, as the peers do, where auto would serve a GGUF "
                         "checkpoint's quantized blocks")
    ap.add_argument("--baseline-venv", default=None,
                    help="adds base and base-local: pagedserve as installed in that venv")
    ap.add_argument("--speculative-config", default='{"method": "ngram"}', metavar="JSON",
                    help="the pagedserve-spec engine's speculative_config")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, nargs=2, default=(16, 256))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 256))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="8 short requests, 1 round")
    ap.add_argument("--quiet", action="store_true", help="hide the engines' own output")
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    ap.add_argument("--min-identical", type=float, default=None,
                    help="exit 1 unless each engine matches the reference on this share of "
                         "requests")
    ap.add_argument("--run-one", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_one:
        return run_one(args)
    if args.quick:
        args.num_requests, args.input_len, args.output_len, args.rounds = 8, (8, 32), (4, 16), 1
    engines = [e for e in args.engines.split(",") if e]
    if args.vllm_venv:
        engines += [e for e in VLLM_ENGINES if e not in engines]
    if args.baseline_venv:
        engines += [e for e in ("base", "base-local") if e not in engines]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        ap.error(f"unknown engines: {sorted(unknown)}")
    if not args.baseline_venv and {"base", "base-local"} & set(engines):
        ap.error("base and base-local need --baseline-venv")
    if not args.vllm_venv and set(VLLM_ENGINES) & set(engines):
        ap.error("vllm and vllm-default need --vllm-venv")
    mdir = model_dir(args.model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(mdir).vocab_size
    work = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), vocab,
                         args.seed)
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="pagedserve-peers-") as tmpdir:
        tmp = Path(tmpdir)
        wfile = tmp / "workload.json"
        wfile.write_text(json.dumps(work))
        for r in range(args.rounds):
            order = engines if r % 2 == 0 else engines[::-1]
            got = {}
            for e in order:
                t0 = time.perf_counter()
                got[e] = launch(e, args, mdir, wfile, tmp)
                print(f"round {r + 1}: {e}: {sum(work['max_tokens']) / got[e]['elapsed_s']:.1f} "
                      f"output tok/s (process {time.perf_counter() - t0:.0f} s)", flush=True)
            rounds.append(got)
    table = report(args, engines, rounds, work, linear_flops_per_token(mdir),
                   gemm_peak_flops(mdir, args.dtype))
    emit_table(table, args.out)
    if args.min_identical is not None and REFERENCE in engines:
        ref = rounds[0][REFERENCE]["outputs"]
        worst = min(agreement(rounds[0][e]["outputs"], ref)[0] for e in engines)
        if worst < args.min_identical * len(ref):
            sys.exit(f"greedy outputs differ from {REFERENCE}: {worst}/{len(ref)} identical")


if __name__ == "__main__":
    main()
