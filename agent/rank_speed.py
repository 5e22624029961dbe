"""Rank speed: which ranks compute persistently slower than the others, from the windows alone.

Decisions only, like the policy: pure functions of arrays, no clocks, no sockets. The controller folds
each window into a `RankSpeedState` (`observe`) and the policy plans with `planning_speeds(state)`.

A rank's speed in one window is the pairs it computed per second of its expert compute, all layers
together (`moewatch.telemetry.rank_speed`). Speed, not time: after a plan in proportion to speed the
slow rank computes fewer pairs and its time falls, while its pairs per second stay what the device
does, so the judgement that put the plan in place does not undo itself.

Per window, a rank's relative speed is its speed over the median of the ranks' speeds in that window
(a machine-wide slowdown, e.g. other work on shared cores, moves every rank alike and cancels). A
window where the rank computed fewer than `min_pairs` pairs measures nothing for it (NaN: too few
pairs give a noisy rate). Over the last `windows` (K) windows:
- measured relative speed = the median of the rank's measured values (noise in one window cannot
  move it);
- a rank becomes slow when each of its last K values was measured and under `slow_below`, and its
  measured relative speed has stayed under `recover_above` (never fast) for at least `min_seconds`
  of windows in a row;
- a slow rank recovers when each of its last K values was measured and above `recover_above`, and its
  measured relative speed has stayed over `slow_below` (never slow) for at least `min_seconds` of
  windows in a row.
Hysteresis: between the two thresholds a rank keeps its state, so a rank hovering near one threshold
does not flap between plans, and a speed between them neither breaks a run nor ends it. A rank that
is not measured (it computed too little) keeps its state, and its runs start again.

Why a floor in seconds as well as windows: a window can be a tenth of a second (a few steps), and
other work on a shared host slows one rank's core for about that long all the time. Moving expert
weights for it costs a stall and buys nothing once the other work has moved on; a device that is
really slow stays slow for minutes.

Shapes: W ranks, n <= K windows kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class RankSpeedParams:
    """The thresholds (the `policy.slow_rank_*` settings), built once by params.from_config."""

    windows: int = 3  # K: the median's span, and how many windows a state change must persist
    min_seconds: float = 10.0  # ...and how much wall time those windows must span at least
    min_pairs: int = 1000  # a window measures a rank's speed only if it computed at least this many pairs
    slow_below: float = 0.85  # relative speed under which a rank counts towards slow
    recover_above: float = 0.95  # relative speed above which a slow rank counts towards recovered
    # While a placement made for speeds is in force, a new one is made only when a rank's measured speed
    # moved by more than this share of the speed the placement was made for.
    replan_change: float = 0.25


@dataclass(frozen=True)
class RankSpeedState:
    """What the estimator keeps of one EP group: the last K windows' relative speeds and each rank's state."""

    relative_history: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # [n, W], NaN: not measured
    speed_history: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # [n, W] pairs per second
    slow: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # [W]
    # [2, W] wall seconds of the windows in a row in which each rank was measured under recover_above
    # (row 0: on its way to slow) and over slow_below (row 1: on its way to recovered).
    run_seconds: np.ndarray = field(default_factory=lambda: np.zeros((2, 0)))

    @property
    def world_size(self) -> int:
        return int(self.slow.shape[0])

    @property
    def relative_speed(self) -> np.ndarray:
        """[W] the median of each rank's measured relative speeds over the kept windows (NaN: none)."""
        return _nanmedian_columns(self.relative_history, self.world_size)

    @property
    def pairs_per_second(self) -> np.ndarray:
        """[W] the median of each rank's measured pairs per compute second over the kept windows."""
        return _nanmedian_columns(self.speed_history, self.world_size)

    @property
    def slow_ranks(self) -> tuple[int, ...]:
        return tuple(int(r) for r in np.flatnonzero(self.slow))


@dataclass(frozen=True)
class RankSpeedChange:
    """What one window changed: ranks that became slow, ranks that recovered."""

    became_slow: tuple[int, ...] = ()
    recovered: tuple[int, ...] = ()


def relative_speeds(speed: np.ndarray, pairs: np.ndarray, min_pairs: int) -> np.ndarray:
    """One window: speed [W] pairs per compute second, pairs [W] pairs computed -> [W] each rank's speed
    over the median of the measured ranks' speeds; NaN for a rank with under `min_pairs` pairs or no
    finite speed, and for every rank when fewer than two were measured (nothing to compare with)."""
    speed = np.asarray(speed, dtype=np.float64)
    pairs = np.asarray(pairs, dtype=np.float64)
    measured = np.isfinite(speed) & (speed > 0) & (pairs >= min_pairs)
    out = np.full(speed.shape, np.nan)
    if measured.sum() < 2:
        return out
    out[measured] = speed[measured] / float(np.median(speed[measured]))
    return out


def observe(state: RankSpeedState, speed: np.ndarray, pairs: np.ndarray, seconds: float,
            params: RankSpeedParams) -> tuple[RankSpeedState, RankSpeedChange]:
    """Fold one window into the state: speed [W] (pairs per compute second), pairs [W] (pairs computed),
    seconds (the window's wall time) -> (the new state, the ranks whose state changed). A window of
    another world size starts afresh."""
    speed = np.asarray(speed, dtype=np.float64)
    W = speed.shape[0]
    if state.world_size != W:
        state = RankSpeedState(np.zeros((0, W)), np.zeros((0, W)), np.zeros(W, dtype=bool), np.zeros((2, W)))
    relative = relative_speeds(speed, pairs, params.min_pairs)
    measured_speed = np.where(np.isfinite(relative), speed, np.nan)
    k = params.windows
    history = np.vstack([state.relative_history, relative[None, :]])[-k:]
    speeds = np.vstack([state.speed_history, measured_speed[None, :]])[-k:]
    # The runs follow the median over K windows (one noisy window neither breaks nor makes one); NaN
    # compares False both ways, so an unmeasured window breaks both.
    median = np.where(np.isfinite(relative), _nanmedian_columns(history, W), np.nan)
    in_run = np.stack([median < params.recover_above, median > params.slow_below])
    run_seconds = np.where(in_run, state.run_seconds + max(float(seconds), 0.0), 0.0)
    slow = state.slow.copy()
    if history.shape[0] == k:
        measured_all = np.isfinite(history).all(axis=0)
        under = measured_all & (np.where(np.isfinite(history), history, np.inf) < params.slow_below).all(axis=0)
        over = measured_all & (np.where(np.isfinite(history), history, -np.inf) > params.recover_above).all(axis=0)
        under &= run_seconds[0] >= params.min_seconds
        over &= run_seconds[1] >= params.min_seconds
        slow = np.where(slow, ~over, under)
    change = RankSpeedChange(tuple(int(r) for r in np.flatnonzero(slow & ~state.slow)),
                             tuple(int(r) for r in np.flatnonzero(state.slow & ~slow)))
    return RankSpeedState(history, speeds, slow, run_seconds), change


def planning_speeds(state: RankSpeedState) -> np.ndarray | None:
    """[W] the relative speeds the planner should place for, or None (equal speeds: today's even
    split) while no rank is persistently slow. A rank not measured lately counts as typical (1.0)."""
    if not state.slow.any():
        return None
    relative = state.relative_speed
    return np.where(np.isfinite(relative) & (relative > 0), relative, 1.0)


def steady_speeds(measured: np.ndarray | None, placed_for: np.ndarray | None, params: RankSpeedParams
                  ) -> np.ndarray | None:
    """[W] the speeds to plan for: the measured ones (planning_speeds), unless the placement in force was
    made for speeds within `replan_change` (a share) of them on every rank; then those, so the planner
    re-finds the map in force and noise moves no slot; likewise while every rank measures at least
    slow_below (a slow rank on its way back, not yet recovered: its recovery will re-plan). Pairs per second are not quite independent of
    the pairs: a rank given fewer pairs pays its fixed costs per expert over fewer of them and reads a
    little slower, which without this margin would feed one plan into the next. None (equal speeds)
    stays None."""
    if measured is None or placed_for is None or len(placed_for) != len(measured):
        return measured
    if float(np.min(measured)) >= params.slow_below:
        return placed_for  # a slow rank recovering, inside the hysteresis band: no plan until it has
    change = np.abs(np.asarray(measured, dtype=np.float64) / np.asarray(placed_for, dtype=np.float64) - 1.0)
    return placed_for if float(np.max(change)) <= params.replan_change else measured


# --- placement figures under rank speeds (the policy's gate and verification use them) ---------------

def rank_seconds(gpu_load: np.ndarray, rank_speed: np.ndarray | None) -> np.ndarray:
    """[L, W] pairs per rank -> [L, W] the time they take, in pair-times of a typical rank (speed 1.0);
    equal speeds when rank_speed is None."""
    load = np.asarray(gpu_load, dtype=np.float64)
    return load if rank_speed is None else load / np.asarray(rank_speed, dtype=np.float64)[None, :]


def time_balancedness(gpu_load: np.ndarray, rank_speed: np.ndarray | None) -> np.ndarray:
    """[L, W] pairs per rank -> [L] mean over max of each rank's time (pairs over speed): balancedness
    by time, which a plan in proportion to speed raises while plain balancedness falls; 1.0 for an
    idle layer."""
    seconds = rank_seconds(gpu_load, rank_speed)
    top = seconds.max(axis=1)
    out = np.ones(seconds.shape[0])
    np.divide(seconds.mean(axis=1), top, out=out, where=top > 0)
    return out


def _nanmedian_columns(values: np.ndarray, width: int) -> np.ndarray:
    out = np.full(width, np.nan)
    if values.size == 0:
        return out
    finite = np.isfinite(values)
    seen = finite.any(axis=0)
    if seen.any():
        # np.median where nothing is missing: the same numbers, and ten times cheaper than nanmedian's
        # masked-array path on a few windows (this runs on every window)
        median = np.median if finite[:, seen].all() else np.nanmedian
        out[seen] = median(values[:, seen], axis=0)
    return out
