"""What a run of triaged windows says, for the policy and for verification: persistent verdicts, the
load each expert computed, the step rate, a measured metric's mean. Pure functions of the windows."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from moewatch import telemetry as tm

from .store import TriagedWindow


def persistent_verdicts(windows: Sequence[TriagedWindow], k: int) -> dict[int, tuple[str, str | None]]:
    """Layers whose verdict and cause were the same, and not healthy, in each of the last k windows."""
    if len(windows) < k:
        return {}
    last = [t.diagnosis.layers for t in windows[-k:]]
    out = {}
    for layer in range(len(last[-1])):
        seen = {(layers[layer].verdict, layers[layer].cause) for layers in last}
        if len(seen) == 1:
            verdict, cause = next(iter(seen))
            if verdict != "healthy":
                out[layer] = (verdict, cause)
    return out


def persistent_overflow(windows: Sequence[TriagedWindow], k: int) -> list[int]:
    if len(windows) < k:
        return []
    last = [t.diagnosis.layers for t in windows[-k:]]
    return [layer for layer in range(len(last[-1])) if all(layers[layer].overflow for layers in last)]


def computed_load(windows: Sequence[TriagedWindow]) -> np.ndarray:
    """[L, E] pairs each expert computed per step, averaged over the windows (drops left out where
    the window counts them; a window that cannot see capacity gives its routed pairs). Windows of
    per-rank totals only (no expert_tokens) say nothing per expert and are left out."""
    counted = [t.window for t in windows if t.window.expert_tokens is not None]
    total = sum(tm.kept_tokens(w).astype(np.float64) for w in counted)
    steps = sum(max(w.steps, 1) for w in counted)
    return total / steps


def steps_per_second(windows: Sequence[TriagedWindow]) -> float:
    """Forward steps per second: from the measured step times, else (a window without per-step
    data) from the window's own span, which every source states."""
    steps, seconds = 0, 0.0
    for t in windows:
        w = t.window
        if w.step_seconds is not None:
            steps += len(w.step_seconds)
            seconds += float(w.step_seconds.sum())
        else:
            steps += w.steps
            seconds += w.end_time - w.start_time
    return steps / seconds if seconds > 0 else 0.0


def measured(windows: Sequence[TriagedWindow], layer: int, key: str, digits: int = 4) -> float | None:
    """A measured metric's mean for a decision's numbers; None when no window measured it (absent
    evidence is reported as unknown, never as a number)."""
    value = mean_metric(windows, layer, key)
    return round(value, digits) if math.isfinite(value) else None


def mean_metric(windows: Sequence[TriagedWindow], layer: int, key: str) -> float:
    """A layer metric's mean over the windows that measured it; NaN when none did."""
    values = [t.diagnosis.layers[layer].metrics.get(key) for t in windows]
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else float("nan")
