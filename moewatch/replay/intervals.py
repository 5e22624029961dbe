"""When a policy rebalances at a given interval, and on what load.

An interval is counted in forward steps (vLLM's `step_interval`, SGLang's
`--eplb-rebalance-num-iterations`) or in windows ("4w"). Rebalances happen at window boundaries (the
replay knows the load per window, not per step): after the first window at which the steps (or
windows) since the previous rebalance reach the interval. Each rebalance is given the load of the
windows since the previous one (the engine's recorder summed over the interval), and its map is in
force from the next window on, until the next rebalance. None happens after the last window (nothing
would measure it).

Sizes: T windows, L layers, E experts, R rebalances.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..errors import InputError

INTERVAL = re.compile(r"^(?P<count>[1-9][0-9]*)(?P<unit>w?)$")


@dataclass(frozen=True)
class Interval:
    count: int
    unit: str  # "steps" | "windows"

    @property
    def label(self) -> str:
        return f"{self.count}w" if self.unit == "windows" else str(self.count)

    def steps(self, steps_per_window: float) -> int:
        """The interval in steps (windows times the recording's median steps per window)."""
        return self.count if self.unit == "steps" else max(1, int(round(self.count * steps_per_window)))


def parse_intervals(text: str) -> tuple[Interval, ...]:
    """"500,1000,4w" -> intervals (steps, or windows with a `w`), in the order given, repeats dropped;
    InputError naming --intervals and the value."""
    out: list[Interval] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        match = INTERVAL.match(part)
        if not match:
            raise InputError("--intervals", f"{part!r} is not a positive whole number of steps (500) or windows (4w)")
        interval = Interval(int(match["count"]), "windows" if match["unit"] else "steps")
        if interval not in out:
            out.append(interval)
    if not out:
        raise InputError("--intervals", "no interval given")
    return tuple(out)


def default_intervals(num_windows: int) -> tuple[Interval, ...]:
    """1, 2, 4, ... windows while each still gives at least two rebalances."""
    out, count = [], 1
    while (num_windows - 1) // count >= 2:
        out.append(Interval(count, "windows"))
        count *= 2
    return tuple(out) or (Interval(1, "windows"),)


def rebalance_points(steps: np.ndarray, interval: Interval) -> list[int]:
    """[T] steps per window -> the windows after which a rebalance happens (never after the last)."""
    points, since_steps, since_windows = [], 0, 0
    for t, n in enumerate(steps[:-1]):
        since_steps += int(n)
        since_windows += 1
        if (since_windows if interval.unit == "windows" else since_steps) >= interval.count:
            points.append(t)
            since_steps = since_windows = 0
    return points


def rebalance_loads(loads: np.ndarray, points: list[int]) -> np.ndarray:
    """[T, L, E] loads, rebalance points -> [R, L, E] each rebalance's load: the windows since the
    previous rebalance (from the first window for the first), summed."""
    if not points:
        return np.zeros((0, *loads.shape[1:]))
    return np.stack([loads[a:b + 1].sum(axis=0) for a, b in _spans(points)])


def window_steps_of(steps: np.ndarray, points: list[int]) -> list[int]:
    """Steps each rebalance's load was summed over."""
    return [int(steps[a:b + 1].sum()) for a, b in _spans(points)]


def _spans(points: list[int]) -> list[tuple[int, int]]:
    """Rebalance points -> (first, last) window each rebalance's load covers: from the window after the
    previous rebalance (the first window for the first) to its own."""
    return list(zip([0] + [p + 1 for p in points[:-1]], points))


def maps_over_time(initial: np.ndarray, points: list[int], rebalanced: np.ndarray, num_windows: int) -> np.ndarray:
    """[L, P] initial map, rebalance points, [R, L, P] the map each rebalance returned -> [T, L, P] the
    map in force in each window."""
    out = np.empty((num_windows, *initial.shape), dtype=np.int64)
    current, r = initial, 0
    for t in range(num_windows):
        out[t] = current
        if r < len(points) and points[r] == t:
            current = rebalanced[r]
            r += 1
    return out
