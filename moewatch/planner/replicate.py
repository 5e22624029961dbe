"""How many replicas each expert gets: the hottest expert per replica gets the next slot.

Giving the next slot to the expert with the largest load per replica, one slot at a time, minimises
the largest load a single replica carries: no packing onto GPUs can do better than that bound, so
the packing starts from the best one. Done here in closed form (water-filling by bisection on the
per-replica load) and finished greedily, for all layers at once.
"""

from __future__ import annotations

import math

import numpy as np

_BISECTION_STEPS = 32


def replica_counts(load: np.ndarray, num_slots: int) -> np.ndarray:
    """[L, E] load -> [L, E] int64 replica counts, each >= 1, each row summing to num_slots.

    Equal to handing out the P - E extra slots one by one to argmax(load / count) (first expert on
    ties). Idle layers spread their extra slots round-robin.
    """
    load = np.asarray(load, dtype=np.float64)
    L, E = load.shape
    if num_slots < E:
        raise ValueError(f"num_slots: {num_slots} slots cannot hold {E} experts")
    counts = np.ones((L, E), dtype=np.int64)
    extra = num_slots - E
    if extra == 0:
        return counts
    busy = load.sum(axis=1) > 0
    if (~busy).any():
        counts[~busy] += extra // E
        counts[~busy, : extra % E] += 1
    if busy.any():
        counts[busy] = _water_fill(load[busy], num_slots)
    return counts


def capped_replica_counts(load: np.ndarray, num_slots: int, max_replicas: int) -> np.ndarray:
    """[L, E] load -> [L, E] replica counts summing to num_slots, each in [1, max_replicas] where the
    slots allow it (the water-filling above, then the excess handed to the experts with the most
    load per replica that are still under the cap)."""
    counts = replica_counts(load, num_slots)
    L, E = counts.shape
    cap = max(max_replicas, math.ceil(num_slots / E))  # the slots must go somewhere
    for layer in range(L):
        row = counts[layer]
        excess = int(np.maximum(row - cap, 0).sum())
        if not excess:
            continue
        row[:] = np.minimum(row, cap)
        for _ in range(excess):
            per_replica = np.where(row < cap, load[layer] / row, -np.inf)
            row[int(np.argmax(per_replica))] += 1
    return counts


def _water_fill(load: np.ndarray, num_slots: int) -> np.ndarray:
    """[L, E] load with every row busy -> [L, E] counts summing to num_slots per row."""
    L, E = load.shape
    # Per-replica load threshold t: counts(t) = max(1, ceil(load / t)) shrinks as t grows.
    # hi always fits (counts(hi) sums to <= P), lo never does (or is the lower bound).
    hi = load.max(axis=1)
    lo = load.sum(axis=1) / num_slots * (1.0 - 1e-12)
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        fits = counts_at_threshold(load, mid).sum(axis=1) <= num_slots
        hi = np.where(fits, mid, hi)
        lo = np.where(fits, lo, mid)
    counts = counts_at_threshold(load, hi)
    # The rest, one slot at a time: only ties at the threshold remain, so this loop is short.
    remaining = num_slots - counts.sum(axis=1)
    rows = np.arange(L)
    while remaining.max() > 0:
        todo = remaining > 0
        ratio = load[todo] / counts[todo]
        pick = np.argmax(ratio, axis=1)
        counts[rows[todo], pick] += 1
        remaining[todo] -= 1
    return counts


def counts_at_threshold(load: np.ndarray, threshold: np.ndarray) -> np.ndarray:
    """[L, E] load, [L] most load a replica may carry (> 0) -> [L, E] the fewest replicas each expert
    needs for that (at least one)."""
    t = threshold[:, None]
    return np.maximum(1, np.ceil(load / t - 1e-9)).astype(np.int64)
