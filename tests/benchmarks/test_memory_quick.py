"""``pagedserve bench memory --quick`` end to end: sane JSON, plots, and the targets' directions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pagedserve.cli import main


@pytest.fixture(scope="module")
def memory_doc(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("memory")
    assert main(["bench", "memory", "--quick", "--no-progress", "--out", str(out)]) == 0
    return out, json.loads((out / "memory.json").read_text())


def test_files_and_command(memory_doc: tuple[Path, dict]) -> None:
    out, doc = memory_doc
    for name in ("memory.md", "memory_heatmap.png", "memory_utilisation.png",
                 "memory_waste.png", "memory_block_size.png"):
        assert (out / name).stat().st_size > 1000, name
    assert doc["command"].startswith("pagedserve bench memory --quick")
    assert "no-compute" in doc["executor"]
    assert doc["command"] in (out / "memory.md").read_text()


def test_every_run_is_sane(memory_doc: tuple[Path, dict]) -> None:
    _, doc = memory_doc
    for key, r in doc["runs"].items():
        assert r["finished_sequences"] == r["num_requests"] * r["n"], key
        assert 0.0 < r["utilisation_steady"] <= 1.0, key
        shares = r["pool_shares_steady"]
        assert all(v >= -1e-9 for v in shares.values()), key
        if key.startswith("policy/"):  # no sharing: the split covers the pool exactly
            assert math.isclose(sum(shares.values()), 1.0, abs_tol=1e-6), key
        assert r["max_concurrent_sequences"] >= 1


def test_target_directions(memory_doc: tuple[Path, dict]) -> None:
    _, doc = memory_doc
    runs = doc["runs"]
    for wl in ("sharegpt", "alpaca"):
        u = {p: runs[f"policy/{wl}/{p}"]["utilisation_steady"]
             for p in ("paged", "reserve", "reserve-pow2", "reserve-oracle")}
        # paged > Oracle > Pow2 > Max, as in the paper's Fig. 2
        assert u["paged"] > u["reserve-oracle"] > u["reserve-pow2"] > u["reserve"], (wl, u)
        c = {p: runs[f"policy/{wl}/{p}"]["max_concurrent_sequences"] for p in u}
        assert c["paged"] >= 2.5 * c["reserve"], (wl, c)
        assert runs[f"policy/{wl}/reserve"]["pool_shares_steady"][
            "external_fragmentation"] == 0.0  # equal reservations tile the pool
    assert runs["policy/sharegpt/paged"]["utilisation_steady"] >= 0.95
    assert runs["policy/sharegpt/reserve"]["utilisation_steady"] <= 0.45
    # Sharing saves memory, more with more samples and with a longer shared prefix.
    ps = [runs[f"parallel/alpaca/n{n}"]["sharing_saving"] for n in (2, 4)]
    assert 0.0 < ps[0] < ps[1] < 0.5
    assert 0 < runs["prefix/alpaca/80"]["sharing_saving"] < runs["prefix/alpaca/341"][
        "sharing_saving"]
    # Bigger blocks waste more of the last block.
    bs = [runs[f"block_size/alpaca/{b}"]["utilisation_steady"] for b in (8, 16, 64)]
    assert bs[0] > bs[1] > bs[2]
    t = doc["targets"]
    assert t["paged_utilisation_at_least_96pct"]["value"] > t[
        "reserve_utilisation_near_20_40pct"]["value"]
