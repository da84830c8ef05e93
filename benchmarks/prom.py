"""A small reader for the Prometheus text format that ``/metrics`` serves.

Only what the serving benchmark needs: plain samples, and histograms rebuilt from their
``_bucket`` / ``_sum`` / ``_count`` series so that two scrapes can be subtracted.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

__all__ = ["Histogram", "Metrics", "histogram_quantile", "parse_metrics"]

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class Histogram:
    """Cumulative bucket counts by upper bound (``inf`` last), their sum and count."""

    bounds: list[float] = field(default_factory=list)
    cumulative: list[float] = field(default_factory=list)
    sum: float = 0.0
    count: float = 0.0

    def minus(self, earlier: Histogram) -> Histogram:
        """The observations made between ``earlier`` and this scrape."""
        if not earlier.bounds:
            return self
        if earlier.bounds != self.bounds:
            raise ValueError("histograms with different buckets cannot be subtracted")
        return Histogram(
            list(self.bounds),
            [a - b for a, b in zip(self.cumulative, earlier.cumulative, strict=True)],
            self.sum - earlier.sum,
            self.count - earlier.count,
        )

    def counts(self) -> list[float]:
        """Per-bucket (not cumulative) counts."""
        out, prev = [], 0.0
        for c in self.cumulative:
            out.append(c - prev)
            prev = c
        return out


@dataclass
class Metrics:
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    def value(self, name: str, default: float = 0.0, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return self.samples.get(key, default)

    def histogram(self, name: str) -> Histogram:
        buckets: list[tuple[float, float]] = []
        for (n, labels), v in self.samples.items():
            if n == name + "_bucket":
                le = dict(labels).get("le", "+Inf")
                buckets.append((math.inf if le in ("+Inf", "Inf") else float(le), v))
        buckets.sort()
        return Histogram(
            [b for b, _ in buckets],
            [v for _, v in buckets],
            self.value(name + "_sum"),
            self.value(name + "_count"),
        )


def parse_metrics(text: str) -> Metrics:
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        try:
            samples[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            continue
    return Metrics(samples)


def histogram_quantile(h: Histogram, q: float, *, integer: bool = False) -> float:
    """The ``q`` quantile, interpolated linearly inside its bucket (as Prometheus does; the
    first bucket starts at 0). With ``integer`` the observations are whole numbers, so a
    bucket ``(lo, hi]`` holds ``lo + 1 ... hi`` and a one-wide bucket gives exactly ``hi``.
    NaN for an empty histogram; the highest finite bound when the quantile falls in the
    overflow bucket."""
    if not h.bounds or h.count <= 0:
        return math.nan
    rank = q * h.cumulative[-1]
    lower, prev = 0.0, 0.0
    for bound, cum in zip(h.bounds, h.cumulative, strict=True):
        if cum >= rank and cum > prev:
            if math.isinf(bound):
                return lower
            frac = (rank - prev) / (cum - prev)
            if integer:
                first = math.floor(lower) + 1
                return first + (bound - first) * frac
            return lower + (bound - lower) * frac
        lower, prev = (bound if not math.isinf(bound) else lower), cum
    return lower
