"""Placement and all-to-all order together: the predicted exchange time of each combination.

A placement decides how many rows cross between ranks (affinity placement keeps a token's pairs near
where it starts; balancing evens the receivers); the schedule decides in which order the rows that
still cross go. For each placement and each schedule this predicts the all-to-all seconds of one
pass of a routing trace over links of a known rate: `aurora` at the bound (max row or column sum
over the rate), `none` by the fair-share fluid model of every transfer at once (a2a_schedule.py).
The fluid model has no TCP loss or incast collapse, so it is the unscheduled exchange at its best:
what the measured benchmark (`moewatch bench a2a`) adds to it is what real links cost.

Sizes: L layers, E experts, P slots, W ranks.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..plan import A2A_SCHEDULES
from .a2a_schedule import exchange_seconds
from .origins import rank_matrices


def joint_prediction(origin_load: np.ndarray, placements: Mapping[str, np.ndarray], row_bytes: float,
                     link_bytes_per_second: float) -> dict[str, dict[str, float]]:
    """[W, L, E] pairs by the rank tokens start on, {name: [L, P] placement}, bytes per row, link rate
    -> {placement: {schedule: seconds of dispatch + combine over all layers}} (module docstring)."""
    if link_bytes_per_second <= 0 or row_bytes <= 0:
        raise ValueError("row_bytes and link_bytes_per_second must be positive")
    out: dict[str, dict[str, float]] = {}
    for name, pmap in placements.items():
        mats = np.rint(rank_matrices(origin_load, pmap)).astype(np.int64)
        out[name] = {schedule: float(2.0 * exchange_seconds(mats, row_bytes, link_bytes_per_second, schedule).sum())
                     for schedule in A2A_SCHEDULES}
    return out


def even_origins(load: np.ndarray, num_ranks: int) -> np.ndarray:
    """[L, E] pairs -> [W, L, E] with every rank starting an equal share of each expert's pairs (what
    a trace without token origins says: nothing ties a token to a rank)."""
    load = np.asarray(load, dtype=np.float64)
    return np.broadcast_to(load / num_ranks, (num_ranks, *load.shape)).copy()
