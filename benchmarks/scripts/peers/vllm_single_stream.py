"""vLLM's side of ``benchmarks/scripts/single_stream.py``: one request, prefill then decode.

Runs ONLY with the Python of a separate virtual environment holding vLLM's CPU build (see
``vllm_generate.py`` beside it), from a working directory outside this repository. Its one
argument is a JSON object (model, dtype, prompt token ids, new tokens, repeats); it prints
``RESULT {"pp_s": ..., "tg_s": ...}``: the best time of a 1-token and of a ``new``-token greedy
generation of that prompt.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; one request needs far less


def main() -> None:
    from vllm import LLM, SamplingParams

    a = json.loads(sys.argv[1])
    llm = LLM(a["model"], dtype=a["dtype"], block_size=32, enforce_eager=True,
              max_model_len=1024, skip_tokenizer_init=True, seed=0)
    calls = iter(range(1 << 30))

    def timed(max_tokens: int) -> float:
        # Rotated anew each call, as single_stream.py does: no prefix-cache hit.
        k = next(calls) % len(a["prompt"])
        prompt = [{"prompt_token_ids": a["prompt"][k:] + a["prompt"][:k]}]
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            detokenize=False)
        t0 = time.perf_counter()
        llm.generate(prompt, sp, use_tqdm=False)
        return time.perf_counter() - t0

    timed(a["new"])  # warm-up
    pp = min(timed(1) for _ in range(a["repeats"]))
    tg = min(timed(a["new"]) for _ in range(a["repeats"]))
    print("RESULT", json.dumps({"pp_s": pp, "tg_s": tg}), flush=True)


if __name__ == "__main__":
    main()
