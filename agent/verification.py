"""Verification: after a plan's Ack, whether the change held or made a layer worse (roll it back).

The judgement compares each window of the new epoch with a control for the same traffic, the old
placement on that window's load (`verify`), from a LayerBaseline recorded before the change
(`make_baseline`). Decisions only, like the policy: no sockets, files or clocks.

A layer placed for rank speeds (a persistently slow rank: the baseline carries the speeds) is judged
by time alone: such a plan gives the slow rank fewer pairs on purpose, so its plain balancedness
falls while the step gets faster, and a balancedness criterion would roll back every good one. The
old map's "busiest rank" is then the one whose pairs take longest at those speeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from moewatch.planner import placement_math as pm

from .evidence import computed_load, mean_metric
from .rank_speed import rank_seconds
from .store import TriagedWindow


@dataclass(frozen=True)
class VerifyParams:
    """What verification needs of the configuration (the `verify` section), built once by params.from_config."""

    windows: int  # windows of the new epoch compared with those before
    rollback_balancedness_drop: float
    rollback_time_rise: float


@dataclass(frozen=True)
class LayerBaseline:
    """A changed layer's state before the change, for verification."""

    layer: int
    balancedness: float  # measured, mean over the windows the decision used
    layer_seconds: float  # measured per-step layer time (slowest rank), mean
    compute_seconds: float  # measured per-step expert compute of the slowest rank, mean
    model_max_gpu_load: float  # the model's busiest-GPU pairs per step for the old map on that load
    model_bias: float  # measured minus model balancedness of the old placement on the same load
    old_map: np.ndarray  # [P] the layer's placement before
    old_capacity: float
    # [W] the relative speeds the new placement was made for (None: equal speeds). With speeds, the
    # busiest GPU is the slowest by time (pairs over speed) and balancedness is not a criterion.
    rank_speed: np.ndarray | None = None


def make_baseline(windows: Sequence[TriagedWindow], layer: int, old_map: np.ndarray, old_capacity: float,
                  num_gpus: int, rank_speed: np.ndarray | None = None) -> LayerBaseline:
    """A layer's state before a change, from the windows the decision used. old_map: [P]; rank_speed:
    [W] the relative speeds the change was planned for (None: equal)."""
    load = computed_load(windows)[layer:layer + 1]
    measured = mean_metric(windows, layer, "balancedness")
    model = float(pm.placement_balancedness(load, old_map[None, :], num_gpus)[0])
    speed = None if rank_speed is None else np.asarray(rank_speed, dtype=np.float64)
    busiest = _busiest(load, old_map, num_gpus, speed)
    return LayerBaseline(layer, measured, mean_metric(windows, layer, "layer_seconds_per_step"),
                         mean_metric(windows, layer, "compute_seconds_per_step"), busiest, measured - model,
                         np.array(old_map), float(old_capacity), speed)


def _busiest(load: np.ndarray, row: np.ndarray, num_gpus: int, rank_speed: np.ndarray | None) -> float:
    """[1, E] load, [P] placement -> the busiest GPU's pairs per step, or (with speeds) the slowest
    GPU's time in pair-times of a typical rank."""
    return float(rank_seconds(pm.gpu_load(load, np.asarray(row)[None, :], num_gpus), rank_speed).max())


@dataclass(frozen=True)
class Verification:
    status: str  # wait | keep | rollback
    worse_layers: tuple[int, ...] = ()
    reason: str = ""
    numbers: dict[int, dict[str, float]] = field(default_factory=dict)


# Verification decides on at least this many windows of the new epoch (verify.windows may ask more),
# and waits up to VERIFY_PATIENCE times as many for a regression seen in the median to persist.
MIN_VERIFY_WINDOWS = 3
VERIFY_PATIENCE = 3


def _layer_evidence(base: LayerBaseline, window: TriagedWindow, num_gpus: int) -> dict[str, float]:
    """One window of the new epoch against the control for the same traffic: the old map on this
    window's load (its balancedness, corrected by the model's bias measured before the change, and
    its time per step). The time control is the time before, its slowest-rank compute scaled by how
    the old map's busiest GPU grows or shrinks with this load, and by how fast the machine computes a
    pair now against before (so a machine-wide slowdown, e.g. other work on shared cores, is not
    blamed on the plan, while a plan that makes the layer slow in another way still is)."""
    layer = base.layer
    metrics = window.diagnosis.layers[layer].metrics
    load = computed_load([window])[layer:layer + 1]
    old_row = base.old_map[None, :]
    old_model = float(pm.placement_balancedness(load, old_row, num_gpus)[0])
    growth = (_busiest(load, base.old_map, num_gpus, base.rank_speed) / base.model_max_gpu_load
              if base.model_max_gpu_load > 0 else 1.0)
    speed = 1.0
    compute = metrics.get("compute_seconds_per_step")
    new_busiest = _busiest(load, np.asarray(window.window.physical_to_logical_map)[layer], num_gpus, base.rank_speed)
    if (compute is not None and math.isfinite(compute) and new_busiest > 0 and base.model_max_gpu_load > 0
            and base.compute_seconds > 0 and math.isfinite(base.compute_seconds)):
        per_pair_now = compute / new_busiest
        per_pair_before = base.compute_seconds / base.model_max_gpu_load
        speed = min(2.0, max(0.5, per_pair_now / per_pair_before))
    seconds = metrics.get("layer_seconds_per_step")
    balancedness = metrics.get("balancedness")  # absent evidence: NaN, which never reads as a regression
    # Placed for rank speeds: no balancedness control (NaN never reads as a regression); time decides.
    control = float("nan") if base.rank_speed is not None else min(1.0, old_model + base.model_bias)
    return {"balancedness": float("nan") if balancedness is None else float(balancedness),
            "balancedness_control": control,
            "seconds": float("nan") if seconds is None else float(seconds),
            "seconds_control": (base.layer_seconds + base.compute_seconds * (growth - 1.0)) * speed,
            "machine_speed": speed}


def verify(baseline: dict[int, LayerBaseline], windows: Sequence[TriagedWindow], params: VerifyParams,
           num_gpus: int) -> Verification:
    """Judge a plan from `windows` (only those of its epoch: the caller fences).

    Each window of the new epoch is compared, per changed layer, with the control for the same
    traffic (`_layer_evidence`: the old map on that window's load). A layer regressed when
    - its balancedness is below the control's by more than params.rollback_balancedness_drop (not
      for a layer placed for rank speeds, which lowers it on purpose), or
    - its time per step is above the control's by more than params.rollback_time_rise.
    Noise cannot decide alone: the verdict uses the median over the last n windows
    (n = max(params.windows, MIN_VERIFY_WINDOWS)), and a rollback also needs the regression in every
    one of those n windows (it persists). A median regression that does not persist waits for more
    windows, up to VERIFY_PATIENCE * n of them, then the plan is kept. Comparing with the old map on
    the same traffic keeps a shift in traffic after the change (drift) from being blamed on it.
    """
    n = max(params.windows, MIN_VERIFY_WINDOWS)
    if len(windows) < n:
        return Verification("wait")
    recent = list(windows[-n:])
    worse, numbers, reasons, unsettled = [], {}, [], []
    for layer, base in baseline.items():
        seen = [_layer_evidence(base, t, num_gpus) for t in recent]
        drop = np.array([e["balancedness"] - e["balancedness_control"] for e in seen])
        rise = np.array([e["seconds"] / e["seconds_control"] - 1.0
                         if math.isfinite(e["seconds"]) and e["seconds_control"] > 0 else float("nan") for e in seen])
        med = {k: float(np.median([e[k] for e in seen])) for k in seen[0]}
        numbers[layer] = {"balancedness_before": base.balancedness, "balancedness_after": med["balancedness"],
                          "balancedness_old_map_same_load": med["balancedness_control"],
                          "layer_seconds_before": base.layer_seconds, "layer_seconds_after": med["seconds"],
                          "layer_seconds_old_map_same_load": med["seconds_control"],
                          "machine_speed": med["machine_speed"], "windows": n,
                          "rank_speed": None if base.rank_speed is None else [float(x) for x in base.rank_speed]}
        balance_median = float(np.median(drop)) < -params.rollback_balancedness_drop
        balance_persists = bool(np.all(drop < -params.rollback_balancedness_drop))
        timed = rise[np.isfinite(rise)]
        time_median = len(timed) == n and float(np.median(timed)) > params.rollback_time_rise
        time_persists = len(timed) == n and bool(np.all(timed > params.rollback_time_rise))
        if balance_median and balance_persists:
            worse.append(layer)
            reasons.append(f"layer {layer} balancedness {med['balancedness']:.3f} vs {med['balancedness_control']:.3f} "
                           f"with the old placement on the same load (median of {n} windows, each worse)")
        elif time_median and time_persists:
            worse.append(layer)
            reasons.append(f"layer {layer} takes {med['seconds'] * 1e3:.2f} ms/step vs {med['seconds_control'] * 1e3:.2f} "
                           f"expected with the old placement on the same load (+{float(np.median(timed)):.0%}, "
                           f"median of {n} windows, each slower)")
        elif balance_median or time_median:
            unsettled.append(layer)
    if worse:
        return Verification("rollback", tuple(worse), "; ".join(reasons), numbers)
    if unsettled and len(windows) < VERIFY_PATIENCE * n:
        return Verification("wait", (), f"layers {unsettled}: a regression in the median that did not persist in "
                            f"every window; waiting for more windows", numbers)
    if unsettled:
        return Verification("keep", (), f"layers {unsettled} regressed in some windows, never in {n} in a row over "
                            f"{len(windows)} windows: kept", numbers)
    return Verification("keep", (), "every changed layer held or improved", numbers)
