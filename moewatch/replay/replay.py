"""The replay itself: each policy's maps over the recorded windows, and what they bought and cost.

Policies:
- "off": the initial map kept (the engine's EPLB off);
- "static": one placement solved from the windows' load (what `moewatch plan --load` writes), kept
  (vLLM: MOEWATCH_EPLB_PLACEMENT; SGLang: --init-expert-location). The operator serves it on traffic
  recorded before, so it is measured out of sample: each half of the windows under the placement
  solved from the other half (two-fold); its one move is the all-windows placement's, from the start;
- "vllm_default", "sglang_deepseek": the engines' own functions, in their environments
  (engine_policies.py), at each interval;
- "moewatch": moewatch's policy (planner/rebalance.py, what the engines' adapters call), gated with the
  fitted cost model, the migration cost and the interval as its horizon.

Per (policy, interval): balancedness of every window under the map in force (each map measured on the
windows that follow it until the next rebalance), slots and bytes moved and stall per rebalance, the
gain over "off" (seconds_per_busiest_pair x the fall in the busiest GPU's pairs, every step), and net
= gain - stall, also per hour of the recorded serving (the windows' own step seconds).

Sizes: T windows, L layers, E experts, P slots, W ranks, R rebalances.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from ..planner.placement_math import placement_balancedness
from ..planner.rebalance import RebalanceSettings, gated_rebalance
from .cost_fit import MigrationCost, StepCost, busiest_pairs_per_step
from .intervals import Interval, maps_over_time, rebalance_loads, rebalance_points, window_steps_of

OFF, STATIC, MOEWATCH = "off", "static", "moewatch"
DYNAMIC = ("vllm_default", "sglang_deepseek", MOEWATCH)
POLICIES = (OFF, STATIC, *DYNAMIC)
MIN_WINDOWS = 4  # fewer recorded windows: no recommendation
MIN_REBALANCES = 2  # an interval with fewer rebalances in the recording is not recommended


@dataclass(frozen=True)
class Geometry:
    """The deployment replayed: the recording's, or the one the operator asks about."""

    slots: int
    ranks: int
    nodes: int
    groups: int
    initial: np.ndarray  # [L, P] map in force at the start


@dataclass(frozen=True)
class Recording:
    """What the replay needs of the recorded windows."""

    loads: np.ndarray  # [T, L, E]
    steps: np.ndarray  # [T]
    step_seconds: np.ndarray  # [T] mean measured step seconds (NaN: none)


def run_figures(rec: Recording, geometry: Geometry, maps: np.ndarray, points: list[int], moved_maps: np.ndarray,
                step_cost: StepCost, migration: MigrationCost, off_busiest: np.ndarray) -> dict[str, Any]:
    """One (policy, interval)'s figures. maps [T, L, P] in force per window; points: windows after
    which it rebalanced; moved_maps [R, L, P] the map each rebalance returned; off_busiest [T] the
    busiest GPU's pairs per step under "off"."""
    T = len(rec.steps)
    weights = rec.steps.astype(np.float64)
    balance = np.array([placement_balancedness(rec.loads[t], maps[t], geometry.ranks).mean() for t in range(T)])
    busiest = busiest_pairs_per_step(rec.loads, maps, rec.steps, geometry.ranks)
    moves = []
    for r, t in enumerate(points):
        end = points[r + 1] if r + 1 < len(points) else T - 1
        following = range(t + 1, end + 1)
        previous = maps[t]
        new = moved_maps[r]
        moves.append(_move(t, int((new != previous).sum()), migration,
                           _mean_balance(rec, previous, following, geometry.ranks),
                           _mean_balance(rec, new, following, geometry.ranks)))
    slots = sum(m["slots_moved"] for m in moves)
    stall = sum(m["stall_seconds"] for m in moves)
    gain = None
    if step_cost.known:
        gain = float(step_cost.seconds_per_busiest_pair * (weights * (off_busiest - busiest)).sum())
    net = None if gain is None else gain - stall
    serving = float((weights * rec.step_seconds).sum()) if np.isfinite(rec.step_seconds).all() else None
    return {
        "rebalances": len(points),
        "balancedness": _step_weighted_mean(balance, rec.steps),
        "balancedness_per_window": balance.tolist(),
        "busiest_pairs_per_step": busiest.tolist(),
        "moves": moves,
        "slots_moved": slots,
        "bytes_moved": slots * migration.expert_bytes,
        "stall_seconds": stall,
        "gain_seconds": gain,
        "net_seconds": net,
        "serving_seconds": serving,
        "net_seconds_per_hour": None if net is None or not serving else net / serving * 3600.0,
    }


def _move(after_window: int, slots: int, migration: MigrationCost, before: float | None,
          after: float | None) -> dict[str, Any]:
    return {"after_window": after_window, "slots_moved": slots, "bytes_moved": slots * migration.expert_bytes,
            "stall_seconds": migration.stall_seconds(slots), "balancedness_before": before,
            "balancedness_after": after}


def _mean_balance(rec: Recording, pmap: np.ndarray, windows: range, ranks: int) -> float | None:
    if not len(windows):
        return None
    b = np.array([placement_balancedness(rec.loads[t], pmap, ranks).mean() for t in windows])
    return _step_weighted_mean(b, rec.steps[list(windows)])


def _step_weighted_mean(per_window: np.ndarray, steps: np.ndarray) -> float:
    """[n] a figure per window, [n] the windows' steps -> the figure's mean over steps (over windows
    when no window has a step)."""
    w = steps.astype(np.float64)
    return float((w * per_window).sum() / w.sum()) if w.sum() else float(per_window.mean())


def moewatch_maps(loads: np.ndarray, window_steps: list[int], initial: np.ndarray, geometry: Geometry,
                  horizon_steps: int, step_cost: StepCost, migration: MigrationCost,
                  base: RebalanceSettings = RebalanceSettings()) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """[R, L, E] rebalance loads -> ([R, L, P] maps, decision records): moewatch's policy called as the
    engines' adapters call it, each from the map before, priced with the replay's cost figures."""
    settings = replace(base, horizon_steps=float(horizon_steps), expert_bytes=migration.expert_bytes,
                       link_bytes_per_second=migration.bytes_per_second,
                       inter_node_bytes_per_second=migration.bytes_per_second)
    if step_cost.known and step_cost.seconds_per_busiest_pair > 0:
        settings = replace(settings, seconds_per_pair=step_cost.seconds_per_busiest_pair)
    current, maps, records = initial, [], []
    for load, steps in zip(loads, window_steps):
        decision = gated_rebalance(load, geometry.slots, geometry.ranks, geometry.nodes, current=current,
                                   settings=replace(settings, window_steps=float(max(steps, 1))))
        current = decision.physical_to_logical_map
        maps.append(current)
        records.append(decision.record())
    return (np.stack(maps) if maps else np.zeros((0, *initial.shape), dtype=np.int64)), records


def static_map(loads: np.ndarray, geometry: Geometry) -> np.ndarray:
    """[T, L, E] -> [L, P] the placement `moewatch plan --load` solves from the windows' summed load."""
    from ..planner.solve import solve_placement

    return solve_placement(loads.sum(axis=0), geometry.ranks, geometry.slots, geometry.nodes).physical_to_logical_map


EngineRunner = Callable[[str, dict[str, np.ndarray]], dict[str, tuple[np.ndarray, list[float]]]]


def replay(rec: Recording, geometry: Geometry, policies: tuple[str, ...], intervals: tuple[Interval, ...],
           step_cost: StepCost, migration: MigrationCost, run_engine: EngineRunner,
           progress: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """Every (policy, interval) -> {"policies": {policy: {interval label: figures}}, "intervals":
    [{label, steps, rebalances}], "static_map"}. "off" and "static" have one entry, label "-".
    run_engine(policy, {sequence: [R, L, E] loads}) returns each sequence's ([R, L, P] maps, seconds)."""
    T = len(rec.steps)
    initial = geometry.initial
    off_maps = np.broadcast_to(initial, (T, *initial.shape))
    off_busiest = busiest_pairs_per_step(rec.loads, off_maps, rec.steps, geometry.ranks)
    steps_per_window = float(np.median(rec.steps)) if T else 0.0
    out: dict[str, Any] = {"policies": {}, "intervals": []}
    none = np.zeros((0, *initial.shape), dtype=np.int64)
    if OFF in policies:
        out["policies"][OFF] = {"-": run_figures(rec, geometry, off_maps, [], none, step_cost, migration,
                                                 off_busiest)}
    if STATIC in policies:
        progress("solving the static placement from all windows, and from each half for the other")
        placed = static_map(rec.loads, geometry)
        out["static_map"] = placed
        half = T // 2
        maps = np.empty((T, *initial.shape), dtype=np.int64)
        if half:
            maps[:half] = static_map(rec.loads[half:], geometry)
            maps[half:] = static_map(rec.loads[:half], geometry)
        else:
            maps[:] = placed
        figures = run_figures(rec, geometry, maps, [], none, step_cost, migration, off_busiest)
        # The stall of its one move, from the start to the placement the operator serves.
        move = _move(-1, int((placed != initial).sum()), migration, None, None)
        figures.update(moves=[move], slots_moved=move["slots_moved"], bytes_moved=move["bytes_moved"],
                       stall_seconds=move["stall_seconds"], out_of_sample="two-fold: each half under the other's")
        if figures["gain_seconds"] is not None:
            figures["net_seconds"] = figures["gain_seconds"] - move["stall_seconds"]
            if figures["serving_seconds"]:
                figures["net_seconds_per_hour"] = figures["net_seconds"] / figures["serving_seconds"] * 3600.0
        out["policies"][STATIC] = {"-": figures}
    schedule = []
    for i, interval in enumerate(intervals):
        points = rebalance_points(rec.steps, interval)
        schedule.append((f"i{i}", interval, points, rebalance_loads(rec.loads, points),
                         window_steps_of(rec.steps, points)))
        out["intervals"].append({"label": interval.label, "steps": interval.steps(steps_per_window),
                                 "unit": interval.unit, "rebalances": len(points),
                                 "enough_rebalances": len(points) >= MIN_REBALANCES})
    for policy in (p for p in policies if p in DYNAMIC):
        calls = sum(len(s[2]) for s in schedule)
        progress(f"{policy}: {calls} rebalance calls over {len(schedule)} interval(s)")
        if policy == MOEWATCH:
            answers = {key: moewatch_maps(loads, steps, initial, geometry, interval.steps(steps_per_window),
                                          step_cost, migration)
                       for key, interval, _, loads, steps in schedule}
            answers = {key: (maps, None, records) for key, (maps, records) in answers.items()}
        else:
            got = run_engine(policy, {key: loads for key, _, _, loads, _ in schedule})
            answers = {key: (maps, seconds, None) for key, (maps, seconds) in got.items()}
        figures = {}
        for key, interval, points, _, _ in schedule:
            maps, seconds, records = answers[key]
            f = run_figures(rec, geometry, maps_over_time(initial, points, maps, T), points, maps, step_cost,
                            migration, off_busiest)
            f["solve_seconds"] = seconds
            if records is not None:
                f["decisions"] = [{k: r[k] for k in ("layers_moved", "layer_outcomes", "experts_moved")}
                                  for r in records]
            figures[interval.label] = f
        out["policies"][policy] = figures
    return out
