"""Statistics of measurements: one percentile definition and one binned rate
series for every benchmark, so two reports never disagree on what "p99" or
"tokens/s over time" means.

``percentile`` is linear interpolation between the closest ranks (numpy's
default, and the vLLM peer harness's that bench/scheduler.py sits beside).
"""
from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) of ``values``; 0.0 when empty."""
    xs = sorted(values)
    if not xs:
        return 0.0
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def rate_series(arrivals: Iterable[tuple[float, int]], t0: float,
                bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    """(bin start seconds since t0, count per second) of (time, count)
    arrivals, in bins of ``bin_s`` from t0 to the last arrival: a throughput
    curve (output tokens/s) with empty bins as zeros, so stalls show."""
    bins: dict[int, int] = {}
    for t, n in arrivals:
        k = int((t - t0) // bin_s)
        bins[k] = bins.get(k, 0) + n
    last = max(bins, default=0)
    return [k * bin_s for k in range(last + 1)], [bins.get(k, 0) / bin_s for k in range(last + 1)]
