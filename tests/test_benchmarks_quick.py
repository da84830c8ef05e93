"""The benchmarks' quick modes run to the end and print their tables, in a fresh process each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks" / "scripts"


def test_controller_step_quick(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "controller_step.md"
    cmd = [sys.executable, str(BENCHMARKS / "controller_step.py"), "--quick", "--label", "quick",
           "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| output length | median µs per step | vs 16 tokens |" in proc.stdout
    assert "| 16 |" in proc.stdout and "| 32 |" in proc.stdout
    assert "## quick" in out.read_text() and "| 16 |" in out.read_text()


def test_chaos_quick(tmp_path: Path) -> None:
    """A storm against the server while the worker is killed twice and the controller once:
    no drops, no failed request, greedy witnesses across each kill equal to an uninterrupted
    run, no leaks, the same greedy text afterwards (the script exits 1 otherwise)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "reliability.md"
    cmd = [sys.executable, str(BENCHMARKS / "chaos.py"), "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=480,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "chaos: PASS" in proc.stdout
    report = out.read_text()
    assert "| drops (no complete answer, no typed error) | 0 |" in report
    assert "| failed requests (no answer a well-run server gives) | 0 |" in report
    assert "| kills / recoveries | 3 / 3 |" in report
    assert report.count(" | 0 | equal (") == 3  # per fault: none failed, the witness equal


def test_peers_quick(tmp_path: Path) -> None:
    """Each of the script's engine runners (pagedserve, Hugging Face static and continuous
    batching; vLLM only when given its venv) runs the workload, and every one's greedy tokens
    equal Hugging Face's (--min-identical 1 exits 1 otherwise). The Ray path differs from the
    in-process one by the backend argument only, and costs a cluster start: CI leaves it out."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    cmd = [sys.executable, str(BENCHMARKS / "peers.py"), "--quick", "--quiet",
           "--min-identical", "1", "--engines", "pagedserve-local,hf-static,hf-cb"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=480,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for engine in ("pagedserve-local", "hf-static", "hf-cb"):
        assert f"| {engine} |" in proc.stdout
    assert "| 8/8 |" in proc.stdout
    assert "CPU seconds over the timed call" in proc.stdout
    assert "- pagedserve-local: " in proc.stdout and "- hf-static" not in proc.stdout


def test_kv_tiers_quick(tmp_path: Path) -> None:
    """Swap against recompute and the prefix cache with and without the host tier: tables,
    plots, no leaked block in either tier, and the tier's hits on the prefix workload."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "kv_tiers"
    cmd = [sys.executable, str(BENCHMARKS / "kv_tiers.py"), "--quick", "--out-dir", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = (out / "kv_tiers.md").read_text()
    assert "| block size | blocks | swap out + in (ms) |" in text
    assert "| 8 | swap |" in text and "| 8 | recompute |" in text
    assert (out / "swap_vs_recompute.png").stat().st_size and (out / "prefix_tier.png").exists()
    prefix = {r["tier"]: r for r in json.loads((out / "kv_tiers.json").read_text())["prefix"]}
    assert prefix["on"]["host_hits"] > 0 and prefix["off"]["host_hits"] == 0
    assert prefix["on"]["hit_rate"] >= 2 * prefix["off"]["hit_rate"]


def test_perplexity_quick(tmp_path: Path) -> None:
    """The perplexity benchmark on the demo checkpoint: its float32 row equals transformers'
    perplexity over the same windows (so the prompt-logprob path scores what it claims), and
    bfloat16 lands within the --check bound of it."""
    import math

    import torch
    import transformers as tf

    from pagedserve.workers.demo import write_demo_checkpoint

    model = write_demo_checkpoint(tmp_path / "demo")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "quantization.md"
    window, count = 24, 2
    cmd = [sys.executable, str(BENCHMARKS / "perplexity.py"), "--model", str(model),
           "--settings", "float32,bfloat16", "--window", str(window),
           "--max-windows", str(count), "--check", "0.05", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {line.split("|")[1].strip(): float(line.split("|")[3])
            for line in out.read_text().splitlines() if line.startswith("| float32")
            or line.startswith("| bfloat16")}
    tok = tf.AutoTokenizer.from_pretrained(model)
    hf = tf.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    ids = tok.encode((BENCHMARKS / "data" / "perplexity.txt").read_text(),
                     add_special_tokens=False)
    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(count):
            chunk = torch.tensor([ids[i * window:(i + 1) * window]])
            logp = torch.log_softmax(hf(chunk).logits[0, :-1].double(), -1)
            total += logp.gather(1, chunk[0, 1:, None]).sum().item()
            n += chunk.shape[1] - 1
    assert math.isclose(rows["float32"], math.exp(-total / n), rel_tol=1e-4), rows
    assert abs(rows["bfloat16"] / rows["float32"] - 1) < 0.05, rows


def test_a_rerun_rewrites_only_its_own_section(tmp_path: Path) -> None:
    """Scripts sharing a results file (chaos.py and fuzz_server.py in reliability.md; the runs
    of controller_step.py) each replace their own section and keep the rest, notes included."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("results_section",
                                                  BENCHMARKS / "results_section.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = tmp_path / "results" / "r.md"
    module.write_section(path, "a", ["## A", "first"], "Title")
    module.write_section(path, "b", ["## B", "one"], "Title")
    path.write_text(path.read_text() + "\nnotes by hand\n")
    module.write_section(path, "a", ["## A", "second"], "Other title")
    text = path.read_text()
    assert text.startswith("# Title\n")
    assert "second" in text and "first" not in text
    assert text.index("## A") < text.index("## B") < text.index("notes by hand")
    assert text.count("<!-- begin a -->") == 1 and "one" in text


def test_layer_step_and_single_stream_quick(tmp_path: Path) -> None:
    """The forward pass timed both ways (compiled layers, modules) on the demo checkpoint, and
    one request's decode and prefill through the in-process engine, with the memory roof."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    cmd = [sys.executable, str(BENCHMARKS / "layer_step.py"), "--model", "demo", "--dtype",
           "float32", "--shapes", "decode:2,prefill:8", "--reps", "2", "--context", "8"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "4 of 4 layers qualify" in proc.stdout
    assert "| decode 2 |" in proc.stdout and "| prefill 8 |" in proc.stdout
    cmd = [sys.executable, str(BENCHMARKS / "single_stream.py"), "--model", "demo", "--dtype",
           "float32", "--engines", "pagedserve-local", "--prompt", "16", "--new", "8",
           "--repeats", "1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "| pagedserve-local |" in proc.stdout
    assert "llama.cpp: skipped" in proc.stdout


def test_proc_cpu_files_this_process_as_the_client() -> None:
    """single_stream.py's CPU-by-role accounting: CPU burnt here shows as the client's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("proc_cpu", BENCHMARKS / "proc_cpu.py")
    proc_cpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(proc_cpu)
    before = proc_cpu.cpu_seconds()
    assert before[os.getpid()][0] == "client"
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:
        pass
    spent = proc_cpu.cpu_by_role(before, proc_cpu.cpu_seconds())
    assert set(spent) == set(proc_cpu.ROLES)
    assert 0.2 <= spent["client"] <= 5.0  # other tests' Ray processes may run meanwhile
