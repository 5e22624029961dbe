"""Watching the engine's own rebalancing: is it still happening, and does each one stall the steps?

Each window says how the engine's rebalancing is configured (extra.rebalancing, moewatch.engine_rebalancing)
and carries a record per rebalance (extra.engine_rebalance). The watch counts the steps the engine ran
since the last rebalance it saw; a rebalance is overdue when none came in OVERDUE_INTERVALS intervals of
steps while the engine stepped (a rebalancing thread that died in silence; an idle engine runs no steps
and is never overdue). Armed only when the adapter observes every rebalance (`observed`): otherwise a
missing record says nothing. Pure: the daemon keeps one Watch per group between windows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moewatch.engine_rebalancing import RebalancingSettings

# The engines' first rebalance comes within one interval of start (vLLM: after a quarter of one), each
# later one an interval after the last: two intervals without one is a rebalancing that stopped.
OVERDUE_INTERVALS = 2


@dataclass(frozen=True)
class Watch:
    settings: RebalancingSettings | None = None
    steps_since: int = 0  # steps since the last rebalance seen, or since the watch was armed
    rebalances: int = 0  # rebalances seen since the watch was armed

    @property
    def armed(self) -> bool:
        return self.settings is not None and self.settings.observed

    @property
    def overdue(self) -> bool:
        return self.armed and self.steps_since > OVERDUE_INTERVALS * self.settings.interval_steps


def step(watch: Watch, settings: RebalancingSettings | None, steps: int, rebalanced: bool) -> Watch:
    """One window: the settings it carried (None: rebalancing off, or not said), its steps, whether it
    carried a rebalance's record -> the watch after it. A rebalance restarts the count with none of the
    window's steps (which of them came after it is unknown: counting none never raises a false alarm);
    settings that stop coming disarm the watch."""
    if settings is None or not settings.observed:
        return Watch(settings)
    if watch.settings is None or not watch.settings.observed:
        watch = Watch(settings)  # armed now: counting starts here
    if rebalanced:
        return Watch(settings, 0, watch.rebalances + 1)
    return Watch(settings, watch.steps_since + max(int(steps), 0), watch.rebalances)


def rebalance_calls(extra: dict) -> int:
    """The rebalances a window's extra records (extra.engine_rebalance): every record that names its engine,
    whoever's policy answered (moewatch's decisions and fallbacks, the engine's own policy's calls)."""
    records = extra.get("engine_rebalance")
    if not isinstance(records, list):
        return 0
    return sum(1 for r in records if isinstance(r, dict) and isinstance(r.get("engine"), str))


def step_stall_seconds(step_seconds: np.ndarray | None) -> float | None:
    """[S] seconds of each step of the window that carried a rebalance -> how much longer its longest
    step ran than the window's median step (a blocking rebalance runs inside one step); None with fewer
    than two steps timed."""
    if step_seconds is None or len(step_seconds) < 2:
        return None
    seconds = np.asarray(step_seconds, dtype=np.float64)
    return float(max(seconds.max() - np.median(seconds), 0.0))
