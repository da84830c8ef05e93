"""Two CPU ranks over gloo produce transformers' greedy tokens: tensor parallelism (KV heads
replicated, QKV bias, tied vocab-parallel embedding / LM head), then decode context parallelism
over the same two ranks with interleave 1 and interleave = block size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.checkpoints import hf_greedy, load_hf_model, make_checkpoint

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
SETUPS = [(1, 1), (2, 1), (2, 4)]  # (dcp, interleave); the block size is 4


def test_tp2_and_dcp2_greedy_match_transformers(tmp_path):
    # One KV head for two ranks: the replicated-KV path that DCP then shards by tokens.
    path = make_checkpoint("qwen2", tmp_path / "ckpt", num_key_value_heads=1)
    prompts = [[1, 17, 99, 4, 250, 31, 77], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 3]]
    port_file, out = tmp_path / "port", tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [str(port_file), str(path), str(out), json.dumps(prompts), json.dumps(SETUPS)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(HELPERS / "tp_run.py"), str(r), "2", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    results = json.loads(out.read_text())
    hf = load_hf_model(path)
    expected = {f"r{i}": hf_greedy(hf, p, 8) for i, p in enumerate(prompts)}
    for setup, result in zip(SETUPS, results, strict=True):
        assert result["kv_heads_per_rank"] == 1
        assert result["outputs"] == expected, f"(dcp, interleave) = {setup}"
