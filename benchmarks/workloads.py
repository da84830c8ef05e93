"""Synthetic workloads: request lengths and arrival times, seeded and dataset free.

Lengths are truncated log-normals fitted to published means (the parameters and their origin
are in ``shared/reference/peers-and-benchmarks.md`` §4.4: only the means are published, the
spread is an assumption). Arrivals are a Gamma renewal process, Poisson at burstiness 1, with
the schedule rescaled so the last request arrives at exactly ``N / rate`` (the convention of
``vllm bench serve``, which removes seed-to-seed drift of the effective rate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "WORKLOADS",
    "LengthDist",
    "Workload",
    "arrival_times",
    "next_pow2",
    "sample_lengths",
]


@dataclass(frozen=True)
class LengthDist:
    """round(lognormal(mu, sigma)), redrawn until it lies in [lo, hi]."""

    mu: float
    sigma: float
    lo: int
    hi: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        out = np.empty(0, dtype=np.int64)
        while out.size < n:
            draw = np.rint(rng.lognormal(self.mu, self.sigma, size=2 * (n - out.size) + 16))
            draw = draw[(draw >= self.lo) & (draw <= self.hi)].astype(np.int64)
            out = np.concatenate([out, draw])
        return out[:n]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    prompt: LengthDist
    output: LengthDist
    max_total: int
    """Pairs whose prompt + output exceed this are redrawn (as ``vllm bench serve`` filters)."""


WORKLOADS: dict[str, Workload] = {
    "sharegpt": Workload(
        "sharegpt",
        "ShareGPT-like lengths as in the vLLM paper (OPT tokenizer): prompt mean 162, output "
        "mean 339, each in [4, 2048]",
        LengthDist(4.434, 1.2, 4, 2048),
        LengthDist(5.435, 1.0, 4, 2048),
        2048,
    ),
    "sharegpt-vllm": Workload(
        "sharegpt-vllm",
        "ShareGPT-like lengths as `vllm bench serve` samples them (Llama-3 tokenizer): prompt "
        "mean 215, output mean 195, each in [4, 1024], pairs at most 2048",
        LengthDist(5.018, 1.2, 4, 1024),
        LengthDist(4.921, 1.0, 4, 1024),
        2048,
    ),
    "alpaca": Workload(
        "alpaca",
        "Alpaca-like lengths as in the vLLM paper: prompt mean 19.3, output mean 58.5",
        LengthDist(2.781, 0.6, 1, 2048),
        LengthDist(3.664, 0.9, 1, 2048),
        2048,
    ),
    "tiny": Workload(
        "tiny",
        "short ShareGPT-shaped lengths for smoke runs: prompt and output in [4, 96]",
        LengthDist(3.2, 0.8, 4, 96),
        LengthDist(3.4, 0.8, 4, 96),
        192,
    ),
}


def sample_lengths(
    workload: Workload, n: int, rng: np.random.Generator, max_total: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` (prompt, output) length pairs; pairs over ``min(max_total, workload's)`` are
    redrawn."""
    cap = workload.max_total if max_total is None else min(max_total, workload.max_total)
    prompts = np.empty(0, dtype=np.int64)
    outputs = np.empty(0, dtype=np.int64)
    while prompts.size < n:
        k = 2 * (n - prompts.size) + 16
        p = workload.prompt.sample(rng, k)
        o = workload.output.sample(rng, k)
        keep = p + o <= cap
        prompts = np.concatenate([prompts, p[keep]])
        outputs = np.concatenate([outputs, o[keep]])
    return prompts[:n], outputs[:n]


def arrival_times(
    n: int, rate: float, rng: np.random.Generator, burstiness: float = 1.0
) -> np.ndarray:
    """Send times (seconds from 0) of ``n`` requests at ``rate`` per second; ``inf`` sends all
    at once. Gamma gaps (shape ``burstiness``), then scaled so the last one is at ``n / rate``."""
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    t = np.cumsum(gaps)
    return t * ((n / rate) / t[-1])


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
