"""The benchmarks' figures (matplotlib, headless). Small PNGs: 100 dpi, few colours."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pagedserve.benchmarks.memory_sim import SimResult

__all__ = [
    "memory_block_size",
    "memory_heatmap",
    "memory_utilisation",
    "memory_waste",
    "serving_batched_tokens",
    "serving_latency",
]

COLORS = {
    "paged": "#1b7837",
    "reserve": "#c51b7d",
    "reserve-pow2": "#e08214",
    "reserve-oracle": "#5e3c99",
}
SHORT = {
    "paged": "paged",
    "reserve": "reserve (Orca-Max)",
    "reserve-pow2": "Orca-Pow2",
    "reserve-oracle": "Orca-Oracle",
}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "axes.titlesize": 10, "figure.dpi": 100})
    return plt


def _save(fig: Any, path: Path) -> None:
    fig.savefig(path, dpi=100, bbox_inches="tight", metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)


def _even_rows(t: list[float], rows: np.ndarray, t_end: float, n: int) -> np.ndarray:
    """Resample snapshots taken at uneven times onto ``n`` even times (last one at or before)."""
    grid = np.linspace(0.0, t_end, n)
    idx = np.clip(np.searchsorted(np.asarray(t), grid, side="right") - 1, 0, len(t) - 1)
    return rows[idx]


def memory_heatmap(paged: SimResult, reserve: SimResult, path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    t_end = min(paged.config.heatmap_until_s, paged.heatmap_t[-1], reserve.heatmap_t[-1])
    im = None
    for ax, res in zip(axes, (paged, reserve), strict=True):
        assert res.heatmap is not None
        bs = res.config.block_size
        raw = _even_rows(res.heatmap_t, res.heatmap[:, 1:], t_end, 240)  # no null block
        rows = np.ma.masked_less(raw.astype(np.float32) / bs, 0)  # free blocks: masked
        cmap = plt.get_cmap("viridis").with_extremes(bad="white")
        im = ax.imshow(rows, aspect="auto", origin="lower", cmap=cmap, vmin=0, vmax=1,
                       interpolation="nearest", extent=(1, rows.shape[1] + 1, 0, t_end))
        s = res.summary
        ax.set_title(f"{SHORT[res.config.policy]}: {s['utilisation_steady']:.1%} of allocated "
                     f"slots hold tokens,\n{s['max_concurrent_sequences']} requests at most")
        ax.set_xlabel("physical block id")
    axes[0].set_ylabel("simulated time (s)")
    cb = fig.colorbar(im, ax=axes, shrink=0.9, pad=0.01)
    cb.set_label("tokens written / block size (white: free block)")
    fig.suptitle(f"Tokens per KV block over time, ShareGPT-like, same pool "
                 f"({paged.summary['num_blocks']} blocks of {paged.config.block_size})",
                 y=1.02)
    _save(fig, path)


def memory_utilisation(results: dict[str, SimResult], path: Path) -> None:
    plt = _plt()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8),
                                 gridspec_kw={"width_ratios": [2.2, 1]})
    for pol, res in results.items():
        s = res.series
        ax.plot(s["t"], np.asarray(s["utilisation"]) * 100, color=COLORS[pol], lw=1.2,
                label=f"{SHORT[pol]} ({res.summary['utilisation_steady']:.0%})")
    lo, hi = next(iter(results.values())).summary["steady_window_s"]
    ax.axvspan(lo, hi, color="0.92", zorder=0, label="steady window")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("slots holding tokens / allocated (%)")
    ax.set_ylim(0, 102)
    ax.set_title("KV utilisation over time, ShareGPT-like")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, fontsize=8,
              frameon=False)
    data = [res.frag_steady * 100 for res in results.values()]
    box = bx.boxplot(data, whis=(5, 95), showfliers=False, patch_artist=True)
    for patch, pol in zip(box["boxes"], results, strict=True):
        patch.set_facecolor(COLORS[pol])
        patch.set_alpha(0.6)
    bx.set_xticks(range(1, len(results) + 1), [SHORT[p].split(" ")[0] for p in results],
                  rotation=20)
    bx.set_ylabel("1 - used / (allocated blocks x B)  (%)")
    bx.set_title("fragmentation over steady steps\n(box: P25-P75, whiskers: P5-P95)")
    bx.set_ylim(0, 100)
    fig.tight_layout()
    _save(fig, path)


_WASTE = (
    ("token_states", "token states", "#1b7837"),
    ("reservation", "reservation", "#fdb863"),
    ("internal_fragmentation", "internal fragmentation", "#e66101"),
    ("external_fragmentation", "external fragmentation", "#b2182b"),
    ("free", "free", "#d9d9d9"),
)


def memory_waste(summaries: dict[str, dict[str, Any]], paper: dict[str, float],
                 path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    pols = list(summaries)
    x = np.arange(len(pols))
    bottom = np.zeros(len(pols))
    for key, label, color in _WASTE:
        vals = np.array([summaries[p]["pool_shares_steady"][key] * 100 for p in pols])
        ax.bar(x, vals, 0.6, bottom=bottom, color=color, label=label, edgecolor="white", lw=0.5)
        if key == "token_states":
            for xi, v in zip(x, vals, strict=True):
                ax.text(xi, v / 2, f"{v:.1f}%", ha="center", va="center", color="white",
                        fontsize=9, fontweight="bold")
        bottom += vals
    ax.scatter(x, [paper[p] * 100 for p in pols], marker="_", s=900, color="black", zorder=5,
               label="paper Fig. 2: token states")
    ax.set_xticks(x, [SHORT[p] for p in pols])
    ax.set_ylabel("share of the KV pool (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Where the KV pool goes, ShareGPT-like (steady state)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def memory_block_size(runs: dict[str, dict[str, Any]], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for name, color in (("sharegpt", "#1b7837"), ("alpaca", "#2166ac")):
        pts = sorted((int(k.split("/")[-1]), r["utilisation_steady"])
                     for k, r in runs.items() if k.startswith(f"block_size/{name}/"))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] * 100 for p in pts], "o-", color=color,
                    label=f"{name}-like")
    ax.set_xscale("log", base=2)
    sizes = sorted({int(k.split("/")[-1]) for k in runs if k.startswith("block_size/")})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.minorticks_off()
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("slots holding tokens / allocated (%)")
    ax.set_title("paged: utilisation against block size")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    _save(fig, path)


# ------------------------------------------------------------------------------ serving
def serving_latency(policies: dict[str, list[dict[str, Any]]], slo: float, path: Path,
                    capacities: dict[str, float | None] | None = None) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for pol, cap in (capacities or {}).items():
        if cap:
            axes[0].plot([cap], [slo], marker="v", ms=9, color=COLORS.get(pol, "0.3"),
                         ls="none", zorder=5)
            axes[0].annotate(f"{cap:.2f} req/s", (cap, slo), textcoords="offset points",
                             xytext=(4, 8), fontsize=8, color=COLORS.get(pol, "0.3"))
    for pol, rows in policies.items():
        rates = [r["rate"] for r in rows]
        for ax, key, title in ((axes[0], "normalized_latency_mean", "mean"),
                               (axes[1], "normalized_latency_p99", "P99")):
            ax.plot(rates, [r[key] for r in rows], "o-", color=COLORS.get(pol, "0.3"),
                    label=SHORT.get(pol, pol))
            ax.set_title(f"{title} normalised latency")
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    for ax in axes:
        ax.axhline(slo, color="0.4", ls="--", lw=1, label=f"SLO {slo:g} s/token")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("latency / output tokens (s/token)")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(FixedLocator(
            [m * 10.0**e for e in range(-4, 3) for m in (1, 2, 5)]))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3, which="major")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def serving_batched_tokens(hists: dict[str, dict[str, Any]], path: Path) -> None:
    """One bar chart per policy: steps per tokens-per-step bucket, under the heaviest load."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    pols = list(hists)
    if not pols:
        _save(fig, path)
        return
    # The overflow bucket's bound is infinite (null once through JSON).
    bounds = [math.inf if b is None else b for b in hists[pols[0]]["bounds"]]
    labels = []
    lo = 0.0
    for b in bounds:
        labels.append(f">{_fmt(lo)}" if math.isinf(b) else (
            _fmt(b) if b - lo <= 1 else f"{_fmt(lo + 1)}-{_fmt(b)}"))
        lo = b if not math.isinf(b) else lo
    # Only the buckets anyone used, plus their neighbours.
    used = [i for i in range(len(bounds)) if any(hists[p]["counts"][i] for p in pols)]
    keep = list(range(max(0, used[0] - 1), min(len(bounds), used[-1] + 2))) if used else []
    width = 0.8 / len(pols)
    x = np.arange(len(keep))
    for j, pol in enumerate(pols):
        counts = np.asarray(hists[pol]["counts"], dtype=float)
        share = counts / max(1.0, counts.sum()) * 100
        ax.bar(x + (j - (len(pols) - 1) / 2) * width, share[keep], width,
               color=COLORS.get(pol, "0.3"),
               label=f"{SHORT.get(pol, pol)} at {hists[pol]['rate']:g} req/s "
                     f"(median {hists[pol]['median']:.1f})")
    ax.set_xticks(x, [labels[i] for i in keep], rotation=45, ha="right")
    ax.set_xlabel("tokens batched in one engine step")
    ax.set_ylabel("share of steps (%)")
    ax.set_title("Batched tokens per step under load")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def _fmt(x: float) -> str:
    return f"{x:g}"
