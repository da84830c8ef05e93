"""``pagedserve bench serving --quick`` end to end: two real ``pagedserve serve`` processes
(local backend, demo model, a KV pool that fits two reserve requests), a two-rate sweep over
HTTP with streaming clients, sane JSON and the scheduling's directions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pagedserve.cli import main


@pytest.fixture(scope="module")
def serving_doc(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("serving")
    assert main(["bench", "serving", "--quick", "--no-progress", "--out", str(out)]) == 0
    return out, json.loads((out / "serving.json").read_text())


def test_files_and_sane_numbers(serving_doc: tuple[Path, dict]) -> None:
    out, doc = serving_doc
    for name in ("serving.md", "serving_latency.png", "serving_batched_tokens.png"):
        assert (out / name).stat().st_size > 1000, name
    assert set(doc["policies"]) == {"paged", "reserve"}
    for name, p in doc["policies"].items():
        assert "--allocation-policy " + name in p["server_command"]
        for r in p["rates"]:
            assert r["completed"] == r["num_requests"], (name, r["errors"])
            expected = sum(q["output"] for q in r["requests"])
            assert r["output_tokens"] == expected > 0
            assert 0 < r["ttft_p50"] <= r["e2e_p50"]
            assert r["normalized_latency_mean"] > 0 and r["tpot_p50"] > 0
            # Every output token was scheduled in some step the histogram counted, or came
            # from a step's later decode passes: up to 7 more for each of up to 4 requests.
            bt, whole = r["batched_tokens"], r["batched_tokens_whole_run"]
            assert 0 < bt["steps"] <= whole["steps"] == sum(whole["counts"])
            scheduled = whole["mean"] * whole["steps"] + 7 * 4 * r["multi_pass_steps"]
            assert scheduled >= r["output_tokens"] - r["completed"]
            assert r["preemptions"] >= 0
            assert not math.isnan(r["itl_p99"])


def test_scheduling_directions(serving_doc: tuple[Path, dict]) -> None:
    # What the scheduler decides, not how fast the machine is: latency, throughput and capacity
    # are the benchmark's figures, which a loaded machine moves either way (never asserted).
    _, doc = serving_doc
    paged, reserve = doc["policies"]["paged"], doc["policies"]["reserve"]
    top_p, top_r = paged["rates"][-1], reserve["rates"][-1]
    # Under load, reserve (2 requests fit its pool) queues; paged batches more: the same tokens
    # in fewer steps over the whole run. (Not the median over the arrival window: prefill chunks
    # move it either way, and a fast engine leaves few steps in that window.)
    whole_p, whole_r = top_p["batched_tokens_whole_run"], top_r["batched_tokens_whole_run"]
    assert whole_p["mean"] > whole_r["mean"] and whole_p["steps"] < whole_r["steps"]
    assert top_r["preemptions"] == 0  # a reservation never grows
