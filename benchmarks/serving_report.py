"""The serving experiment's report: ``serving.md`` and its plots from the results document
(``serving.json``), and the verdict on the targets."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.report import md_table

__all__ = ["render", "replot", "targets"]


def render(doc: dict[str, Any], out: Path) -> None:
    """Write ``serving.md`` and the PNGs from a results document (``serving.json``)."""
    from pagedserve.benchmarks import plots

    per = doc["policies"]
    plots.serving_latency({k: v["rates"] for k, v in per.items()},
                          doc["slo_normalized_latency_s"], out / "serving_latency.png",
                          {k: v["capacity"]["interpolated"] for k, v in per.items()})
    plots.serving_batched_tokens(_loaded_hists(per), out / "serving_batched_tokens.png")
    (out / "serving.md").write_text(_markdown(doc))


def replot(out: Path) -> dict[str, Any]:
    """Redraw the figures and tables of an earlier run from ``out/serving.json``."""
    doc = json.loads((out / "serving.json").read_text())
    render(doc, out)
    print(f"redrew {out}/serving.md and 2 PNGs from serving.json")
    return doc


def _loaded_hists(per: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each policy's batched-tokens histogram (load window) at its highest rate swept."""
    out = {}
    for name, p in per.items():
        if p["rates"]:
            top = max(p["rates"], key=lambda r: r["rate"])
            out[name] = {"rate": top["rate"], **top["batched_tokens"]}
    return out


def targets(doc: dict[str, Any]) -> dict[str, Any]:
    per = doc["policies"]
    if "paged" not in per or "reserve" not in per:
        return {}
    cp, cr = per["paged"]["capacity"], per["reserve"]["capacity"]
    ratio = None
    if cp["interpolated"] and cr["interpolated"]:
        ratio = cp["interpolated"] / cr["interpolated"]
    grid = None
    if cp["max_rate_meeting_slo"] and cr["max_rate_meeting_slo"]:
        grid = cp["max_rate_meeting_slo"] / cr["max_rate_meeting_slo"]
    hp, hr = _loaded_hists(per)["paged"], _loaded_hists(per)["reserve"]
    med = hp["median"] / hr["median"] if hr["median"] else None
    common = sorted({r["rate"] for r in per["paged"]["rates"]}
                    & {r["rate"] for r in per["reserve"]["rates"]})
    at_common = None
    if common:
        rate = common[-1]
        mp = next(r for r in per["paged"]["rates"] if r["rate"] == rate)["batched_tokens"]
        mr = next(r for r in per["reserve"]["rates"] if r["rate"] == rate)["batched_tokens"]
        at_common = {"rate": rate, "paged": mp["median"], "reserve": mr["median"],
                     "ratio": mp["median"] / mr["median"] if mr["median"] else None}
    return {
        "sustained_rate_paged_over_reserve_at_least_2x": {
            "value": {"interpolated": ratio, "swept_grid": grid,
                      "paged": cp, "reserve": cr},
            "met": ratio is not None and ratio >= 2.0,
        },
        "median_batched_tokens_paged_over_reserve_at_least_2x": {
            "value": {"ratio": med, "paged": hp["median"], "reserve": hr["median"],
                      "paged_rate": hp["rate"], "reserve_rate": hr["rate"],
                      "at_highest_common_rate": at_common},
            "met": med is not None and med >= 2.0,
        },
    }


# --------------------------------------------------------------------------- markdown
def _f(x: Any, nd: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _markdown(doc: dict[str, Any]) -> str:
    o = doc["options"]
    out = [
        "# Serving: request-rate sweep over HTTP, paged against reserve",
        "",
        "Produced by (the JSON beside this file holds every number, per request too):",
        "",
        "```",
        doc["command"],
        "```",
        "",
        f"Workload: {doc['workload']}; "
        + (f"arrivals over {o['duration_s']:g} s at every rate (rate x {o['duration_s']:g} "
           f"requests, at least {o['min_requests']})" if o["duration_s"] else
           f"{o['num_requests']} requests per rate")
        + "; Gamma arrivals "
        f"(burstiness {o['burstiness']:g}: Poisson), token-id prompts, `max_tokens` = the "
        "sampled output length with `ignore_eos`, streamed from `/v1/completions` and timed "
        "per server-sent event. Normalised latency = E2E / output tokens, mean over requests "
        f"(the paper's metric); SLO {doc['slo_normalized_latency_s']:g} s/token. "
        f"{doc['machine']}; {doc['wall_seconds']:.0f} s wall"
        + (" (`--quick`)." if doc["quick"] else "."),
        "",
    ]
    for name, p in doc["policies"].items():
        cap = p["capacity"]
        out += [
            f"## `{name}`",
            "",
            f"Server: `{p['server_command'] or o['url']}` (model `{p['model']}`).",
            "",
            f"Highest swept rate meeting the SLO: **{_f(cap['max_rate_meeting_slo'], 2)}** "
            f"req/s (interpolated crossing {_f(cap['interpolated'], 2)})"
            + (f"; {cap['note']}" if cap["note"] else "") + ".",
            "",
            md_table(
                ["rate", "done", "req/s", "out tok/s", "E2E mean / P99 (s)",
                 "norm. lat. mean / P99 (s/tok)", "TTFT P50 / P99 (s)",
                 "TPOT P50 / P99 (ms)", "ITL P99 (ms)", "preempt.",
                 "batched tok/step P10 / P50 / P90 (while arriving)", "peak conc."],
                [[f"{r['rate']:g}", f"{r['completed']}/{r['num_requests']}",
                  _f(r["request_throughput"], 2), _f(r["output_throughput"], 0),
                  f"{_f(r['e2e_mean'], 1)} / {_f(r['e2e_p99'], 1)}",
                  f"{_f(r['normalized_latency_mean'])} / {_f(r['normalized_latency_p99'])}",
                  f"{_f(r['ttft_p50'], 2)} / {_f(r['ttft_p99'], 2)}",
                  f"{_ms(r['tpot_p50'])} / {_ms(r['tpot_p99'])}", _ms(r["itl_p99"]),
                  f"{r['preemptions']:.0f}",
                  f"{_f(r['batched_tokens']['p10'], 1)} / "
                  f"{_f(r['batched_tokens']['median'], 1)} / "
                  f"{_f(r['batched_tokens']['p90'], 1)}",
                  str(r["peak_concurrency"])]
                 for r in p["rates"]],
            ),
            "",
        ]
    if doc["targets"]:
        t1 = doc["targets"]["sustained_rate_paged_over_reserve_at_least_2x"]
        t2 = doc["targets"]["median_batched_tokens_paged_over_reserve_at_least_2x"]
        v1, v2 = t1["value"], t2["value"]
        out += [
            "## Targets",
            "",
            md_table(["target", "measured", "met"], [
                ["paged sustains >= 2x the rate of reserve under the SLO",
                 f"{_f(v1['interpolated'], 2)}x interpolated ({_f(v1['swept_grid'], 2)}x on "
                 "the swept grid)", "yes" if t1["met"] else "**no**"],
                ["median batched tokens per step under load >= 2x reserve",
                 f"{_f(v2['ratio'], 2)}x ({_f(v2['paged'], 1)} at {v2['paged_rate']:g} req/s "
                 f"vs {_f(v2['reserve'], 1)} at {v2['reserve_rate']:g} req/s, each policy's "
                 "highest rate)" + _common(v2["at_highest_common_rate"]),
                 "yes" if t2["met"] else "**no**"],
            ]),
            "",
        ]
    out += ["Batched tokens per step come from the server's "
            "`pagedserve_batched_tokens_per_step` histogram, scraped before the first request "
            "of a rate and right after its last request was sent (the load window; the JSON "
            "also has the whole run, drain included). Quantiles are interpolated inside the "
            "histogram's buckets. A policy's higher rates are skipped after "
            f"{o['stop_after_violations']} consecutive rates miss the SLO.", "",
            "Plots: `serving_latency.png` (mean and P99 normalised latency against rate), "
            "`serving_batched_tokens.png` (tokens per step at each policy's highest rate).",
            ""]
    return "\n".join(out)


def _common(c: dict[str, Any] | None) -> str:
    if not c:
        return ""
    return (f"; at {c['rate']:g} req/s, the highest rate both ran: {_f(c['paged'], 1)} vs "
            f"{_f(c['reserve'], 1)} ({_f(c['ratio'], 2)}x)")


def _ms(x: Any) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{1000 * x:.0f}"

