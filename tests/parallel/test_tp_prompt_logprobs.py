"""Prompt logprobs under tensor parallelism (two CPU ranks over gloo): the vocab-parallel LM
head gathers the logits, so every rank reports the same values, equal to transformers'."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import load_hf_model, make_checkpoint

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


def test_tp2_prompt_logprobs_match_transformers(tmp_path):
    path = make_checkpoint("qwen2", tmp_path / "ckpt", num_key_value_heads=1)  # tied LM head
    prompts = [[1, 17, 99, 4, 250, 31, 77, 8, 300, 41], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
    port_file, out = tmp_path / "port", tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [str(port_file), str(path), str(out), json.dumps(prompts)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(HELPERS / "tp_prompt_logprobs.py"), str(r), "2", *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    per_rank = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert per_rank[0] == per_rank[1]
    hf = load_hf_model(path)
    for i, prompt in enumerate(prompts):
        rows = []
        for step in per_rank[0]:
            if f"r{i}" in step:
                first, ids, lps = step[f"r{i}"]
                pairs = zip(ids, lps, strict=True)
                rows.extend((first + j, a, b) for j, (a, b) in enumerate(pairs))
        assert [p for p, *_ in rows] == list(range(1, len(prompt)))
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        for p, ids, lps in rows:
            assert ids == [prompt[p], *ref[p - 1].topk(i + 1).indices.tolist()]
            assert lps == pytest.approx(ref[p - 1, ids].tolist(), abs=1e-4)
    assert all("plain" not in step for step in per_rank[0])
