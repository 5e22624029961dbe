"""Families of the ranks' measured speed (agent/rank_speed.py): each rank's relative speed and whether
the agent counts it persistently slow, written by the controller after each window."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .family import GROUP, Gauge, families_of

if TYPE_CHECKING:
    from ..rank_speed import RankSpeedState
    from .state import MetricsState

RANK_RELATIVE_SPEED = Gauge(
    "moewatch_rank_relative_speed", (*GROUP, "rank"),
    "The rank's pairs per second of expert compute over the median rank's, the median of the last "
    "policy.slow_rank_windows windows (1 is typical, 0.5 half as fast); absent until measured.")
RANK_SLOW = Gauge(
    "moewatch_rank_slow", (*GROUP, "rank"),
    "1 while the agent counts the rank persistently slow (relative speed under policy.slow_rank_below for "
    "policy.slow_rank_windows windows, until above policy.slow_rank_recover_above as long): plans are then "
    "made for the measured speeds.")

FAMILIES = families_of(globals())


def record_rank_speed(state: MetricsState, group: tuple[str, str], speeds: RankSpeedState) -> None:
    """The group's ranks from the estimator's state: a rank not measured has no speed series."""
    chunk = tuple(map(str, group))
    keys = [(*chunk, str(rank)) for rank in range(speeds.world_size)]
    relative = speeds.relative_speed
    state[RANK_RELATIVE_SPEED].remove_many([k for k, v in zip(keys, relative) if not np.isfinite(v)])
    state[RANK_RELATIVE_SPEED].set_many([(k, float(v)) for k, v in zip(keys, relative) if np.isfinite(v)],
                                        chunk=chunk)
    state[RANK_SLOW].set_many([(k, 1.0 if slow else 0.0) for k, slow in zip(keys, speeds.slow)], chunk=chunk)
