"""Quantiles from the buckets of a Prometheus histogram, the way PromQL's histogram_quantile computes
them, so a number moewatch shows equals the one a dashboard over the same scrape shows.

Edge cases, as in Prometheus:
- q < 0 gives -Inf, q > 1 gives +Inf; no `+Inf` bucket, or fewer than two buckets, gives NaN; no
  observations (count 0) gives NaN;
- within the bucket that holds rank q x count the value is interpolated linearly between its lower
  and upper bound (observations assumed spread evenly in the bucket);
- the lowest bucket's lower bound is 0 when its upper bound is positive (else the quantile is its
  upper bound): latencies are never negative;
- a rank in the `+Inf` bucket gives the highest finite upper bound (nothing above it is known);
- cumulative counts that go down (a scrape racing the writer) are raised to their running maximum.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def histogram_quantile(q: float, upper_bounds: Sequence[float], cumulative_counts: Sequence[float]) -> float:
    """The q-quantile of one histogram. upper_bounds: [B] the buckets' `le` (any order, one of them
    +Inf); cumulative_counts: [B] the observations at or under each bound."""
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    le = np.asarray(upper_bounds, dtype=np.float64)
    counts = np.asarray(cumulative_counts, dtype=np.float64)
    if le.size < 2 or le.shape != counts.shape or not np.isposinf(le).any():
        return math.nan
    order = np.argsort(le, kind="stable")
    le, counts = le[order], np.maximum.accumulate(counts[order])
    total = counts[-1]
    if not total > 0:
        return math.nan
    rank = q * total
    b = int(np.searchsorted(counts, rank, side="left"))
    b = min(b, le.size - 1)
    if np.isposinf(le[b]):
        return float(le[-2])
    if b == 0 and le[0] <= 0:
        return float(le[0])
    lower = 0.0 if b == 0 else float(le[b - 1])
    below = 0.0 if b == 0 else float(counts[b - 1])
    inside = float(counts[b]) - below
    if inside <= 0:
        return float(le[b])
    return lower + (float(le[b]) - lower) * (rank - below) / inside
