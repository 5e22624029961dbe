"""What a rebalance gains and costs, fitted to the recorded windows.

Gain: every collective waits for the busiest GPU, so a step's time is modelled as

    step_seconds = fixed + seconds_per_busiest_pair x B (+ seconds_per_token x tokens per step)

where B is the busiest GPU's pairs per step summed over layers (the window's load spread evenly over
each expert's replicas under the map in force), fitted over the windows that carry step times (one
sample per window: its mean step) by least absolute deviations with every parameter >= 0 (a median
regression: windows slowed by something else, another process on the host, a rebalance's stall, a
pause, move it less than they would a least-squares fit). The per-token term is fitted
only when tokens per step and B vary apart; when they move together (one rank, where B is all pairs,
or a load that never changes balance) it cannot be told apart, and the per-pair cost then holds the
step's other per-token work too: an upper bound on what balance buys, said in `note`. A rebalance
that lowers B by d saves d x seconds_per_busiest_pair per step.

Stall: slots moved x bytes per expert / migration rate; each figure from the operator's flag, else
measured in the windows (the engine's rebalance records: `bytes_moved` over `slots_moved`, and the
longest step of a window that carried a rebalance over its median step), else an assumed default
that the result names as assumed.

Sizes: T windows, L layers, E experts, P slots, W ranks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..planner.cost import CostModel
from ..planner.placement_math import gpu_load
from ..planner.rebalance import RebalanceSettings

MIN_FIT_WINDOWS = 3  # fewer windows with step times: no fit
COLLINEAR = 0.98  # |correlation| of B and tokens per step above which they are not told apart


@dataclass(frozen=True)
class StepCost:
    """Step time against the busiest GPU's pairs; None parameters: not known."""

    seconds_per_busiest_pair: float | None
    fixed_seconds: float | None
    seconds_per_token: float | None
    source: str  # "fitted", "operator" or "unknown"
    model: str  # the model in words
    samples: int
    r2: float | None  # of the fit's predictions; outlier windows count fully (it can be negative)
    note: str = ""
    median_abs_residual_seconds: float | None = None

    @property
    def known(self) -> bool:
        return self.seconds_per_busiest_pair is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def busiest_pairs_per_step(loads: np.ndarray, maps: np.ndarray, steps: np.ndarray, num_gpus: int) -> np.ndarray:
    """[T, L, E] loads, [T, L, P] maps in force, [T] steps -> [T] the busiest GPU's pairs per step,
    summed over layers (0 for a window without steps)."""
    busiest = np.array([gpu_load(load, pmap, num_gpus).max(axis=1).sum() for load, pmap in zip(loads, maps)])
    return np.divide(busiest, steps, out=np.zeros(len(busiest)), where=steps > 0)


def fit_step_cost(busiest: np.ndarray, tokens: np.ndarray, step_seconds: np.ndarray) -> StepCost:
    """[T] busiest GPU pairs per step, [T] tokens per step (NaN: unknown), [T] mean step seconds (NaN:
    unknown) -> the fitted StepCost (source "unknown" with the reason in `note` when it cannot be fitted)."""
    use = np.isfinite(step_seconds) & np.isfinite(busiest)
    n = int(use.sum())
    if n < MIN_FIT_WINDOWS:
        return StepCost(None, None, None, "unknown", "", n, None,
                        f"{n} window(s) carry step times; the fit needs {MIN_FIT_WINDOWS}")
    x, y = busiest[use], step_seconds[use]
    if x.std() <= 1e-12 * max(abs(x).max(), 1e-300):
        return StepCost(None, None, None, "unknown", "", n, None,
                        "the busiest GPU's pairs per step never varied: their cost cannot be fitted")
    t = tokens[use]
    with_tokens = bool(np.isfinite(t).all() and t.std() > 0 and abs(np.corrcoef(x, t)[0, 1]) < COLLINEAR)
    columns = [x, t, np.ones(n)] if with_tokens else [x, np.ones(n)]
    coef = least_absolute_deviations(np.column_stack(columns), y)
    pred = np.column_stack(columns) @ coef
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else None
    residual = float(np.median(np.abs(y - pred)))
    if with_tokens:
        return StepCost(float(coef[0]), float(coef[2]), float(coef[1]), "fitted",
                        "step_seconds = fixed + a x busiest GPU pairs per step + c x tokens per step", n, r2, "",
                        residual)
    return StepCost(float(coef[0]), float(coef[1]), None, "fitted",
                    "step_seconds = fixed + a x busiest GPU pairs per step", n, r2,
                    "tokens per step move with the busiest GPU's pairs in these windows (one rank, or an unchanging "
                    "balance): the per-pair cost holds the step's other per-token work too, so the gain is an upper "
                    "bound", residual)


def least_absolute_deviations(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """[n, k] features, [n] targets -> [k] coefficients >= 0 minimising sum |y - x @ coef|, as a linear
    program: coef and the residual's positive and negative parts u, v >= 0 with x @ coef + u - v = y."""
    from scipy.optimize import linprog  # imported here: scipy.optimize is slow to import

    n, k = x.shape
    scale = np.maximum(np.abs(x).max(axis=0), 1e-300)  # columns of one magnitude for the solver
    cost = np.concatenate([np.zeros(k), np.ones(2 * n)])
    equality = np.hstack([x / scale, np.eye(n), -np.eye(n)])
    solved = linprog(cost, A_eq=equality, b_eq=y, bounds=(0, None), method="highs")
    if not solved.success:
        raise ValueError(f"step cost fit: {solved.message}")
    return solved.x[:k] / scale


def operator_step_cost(seconds_per_pair: float) -> StepCost:
    return StepCost(float(seconds_per_pair), None, None, "operator",
                    "step time falls by --seconds-per-pair x the fall in the busiest GPU's pairs per step", 0, None)


@dataclass(frozen=True)
class MigrationCost:
    """Bytes one slot's expert moves and the rate it moves at, each with where it came from."""

    expert_bytes: float
    expert_bytes_source: str
    bytes_per_second: float
    rate_source: str

    @property
    def assumed(self) -> bool:
        return self.expert_bytes_source.startswith("assumed") or self.rate_source.startswith("assumed")

    def stall_seconds(self, slots_moved: float) -> float:
        """Seconds a blocking move of `slots_moved` slots stalls the steps (asynchronous moves stall less)."""
        return float(slots_moved) * self.expert_bytes / self.bytes_per_second

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "assumed": self.assumed}


def migration_cost(records: list[dict[str, Any]], step_times: list[np.ndarray | None],
                   expert_bytes: float | None = None, bytes_per_second: float | None = None) -> MigrationCost:
    """The operator's figures where given; else measured from the windows' rebalance records (each
    with the index of its `window`) and those windows' [steps] step times; else assumed defaults."""
    sized = [r for r in records if _positive(r.get("bytes_moved")) and _positive(r.get("slots_moved"))]
    if expert_bytes is not None:
        size, size_source = float(expert_bytes), "operator (--expert-bytes)"
    elif sized:
        size = float(np.median([r["bytes_moved"] / r["slots_moved"] for r in sized]))
        size_source = f"measured: bytes_moved / slots_moved of {len(sized)} engine rebalance record(s)"
    else:
        size = RebalanceSettings.expert_bytes
        size_source = "assumed: moewatch's default expert size (no record carries bytes_moved; give --expert-bytes)"
    if bytes_per_second is not None:
        return MigrationCost(size, size_source, float(bytes_per_second), "operator (--migration-rate)")
    moved_bytes, stalled = 0.0, 0.0
    for window in sorted({r["window"] for r in sized if "window" in r}):
        times = step_times[window] if window < len(step_times) else None
        if times is None or len(times) < 2:
            continue
        stall = float(times.max() - np.median(times))
        if stall > 0:
            moved_bytes += sum(r["bytes_moved"] for r in sized if r.get("window") == window)
            stalled += stall
    if stalled > 0 and moved_bytes > 0:
        return MigrationCost(size, size_source, moved_bytes / stalled,
                             "measured: bytes moved over the longest step's excess over the median step, in the "
                             "windows that carried a rebalance")
    return MigrationCost(size, size_source, CostModel.migration_bytes_per_second,
                         "assumed: moewatch's default migration rate (no rebalance measured in the windows; give "
                         "--migration-rate)")


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
