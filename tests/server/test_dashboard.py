"""The Grafana dashboard, the recording rules and docs/metrics.md name only series that a
running server's ``/metrics`` really exposes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.serving.openai.server import build_app

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pagedserve.json"
RULES = ROOT / "deploy" / "prometheus" / "vllm-names.rules.yml"
DOC = ROOT / "docs" / "metrics.md"

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
             "and", "or", "unless", "inf", "nan"}
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The series a PromQL expression selects (not its functions, labels or keywords)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values, strings
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range and subquery selectors, $__rate_interval
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in _IDENT.finditer(e):
        word = m.group()
        after = e[m.end():].lstrip()
        if after.startswith("(") or word.lower() in _KEYWORDS:
            continue  # a function or aggregation, or a keyword
        if m.start() > 0 and (e[m.start() - 1].isdigit() or e[m.start() - 1] == "."):
            continue  # the exponent of a number such as 1e3
        names.add(word)
    return names


def test_the_extractor() -> None:
    expr = ('histogram_quantile(0.99, sum by (le) (rate(a_bucket{instance=~"$instance", '
            'x="rate(b)"}[$__rate_interval]))) / on (job) group_left(z) c_total > 1e3')
    assert metric_names(expr) == {"a_bucket", "c_total"}
    assert metric_names("vllm:x_total offset 5m") == {"vllm:x_total"}


@pytest.fixture(scope="module")
def exposed(llama_dir, srv, tmp_path_factory) -> Iterator[set[str]]:
    """Every sample name a live server exposes, after one request of each kind."""
    # With speculation on, so that its series are exposed too.
    client = srv.start_client(llama_dir, speculative_config={"method": "ngram"})
    app = build_app(client, batch_dir=tmp_path_factory.mktemp("dash") / "batches")
    try:
        with srv.running(app) as url, httpx.Client(base_url=url, timeout=60) as http:
            assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}).is_success
            text = http.get("/metrics").text
    finally:
        app.state.batches.close()
        client.shutdown()
    yield {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    found: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                found.append((p["title"], t["expr"]))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", q)
            assert m is not None, q
            found.append((f"variable {var['name']}", m.group(1)))
    return found


def test_every_dashboard_expression_names_exposed_series(exposed: set[str]) -> None:
    exprs = _dashboard_exprs()
    assert len(exprs) >= 20
    for title, expr in exprs:
        names = metric_names(expr)
        assert names, f"{title}: {expr} selects no series"
        missing = names - exposed
        assert not missing, f"{title}: {sorted(missing)} not in /metrics"


def test_the_dashboard_covers_what_an_operator_watches() -> None:
    dash = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for needed in ("throughput", "first token", "inter-token", "per output token",
                   "end-to-end", "running and waiting", "kv cache usage", "prefix cache hit",
                   "preemptions"):
        assert needed in titles, needed
    assert dash["uid"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_recording_rules_map_exposed_series_to_vllm_names(exposed: set[str]) -> None:
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    records = {r["record"]: r["expr"] for r in rules}
    assert len(records) == len(rules)
    for record, expr in records.items():
        assert record.startswith("vllm:"), record
        assert metric_names(expr) <= exposed and metric_names(expr), (record, expr)
    # Every vLLM name the table maps has a rule (counters and histograms in their series).
    table = [line for line in DOC.read_text().splitlines() if line.startswith("| `pagedserve")]
    mapped = {name for line in table for name in re.findall(r"`(vllm:[a-z0-9_:]+)", line)}
    assert "vllm:num_requests_running" in mapped and "vllm:gpu_cache_usage_perc" in mapped
    for name in mapped - {"vllm:cache_config_info"}:
        assert any(r == name or r.startswith(name + "_") for r in records), name


def test_the_table_names_exposed_series(exposed: set[str]) -> None:
    table = [line for line in DOC.read_text().splitlines() if line.startswith("| `pagedserve")]
    families = {re.sub(r"_(total|bucket|sum|count|created)$", "", s) for s in exposed}
    for line in table:
        first = re.match(r"\| `(pagedserve_[a-z0-9_]+)", line)
        assert first is not None, line
        name = re.sub(r"_total$", "", first.group(1))
        assert name in families, name
