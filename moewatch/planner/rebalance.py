"""One engine rebalance, decided by moewatch: the placement in force mended in place (incremental.py),
then a cost gate per layer. The engines' own live rebalancing (vLLM's EPLB policy, SGLang's eplb algorithm) call
this through their adapters under runtime/engines/; nothing here touches an engine.

Every rank of an engine runs its policy on the same all-reduced load and nothing is broadcast, so the
decision is a pure function of (load, current placement, sizes, settings): no clock (the solve time
is reported, never decided on), no randomness, no state kept between calls.

The gate keeps a layer's current row unless the predicted gain pays for that layer's move:
- gain: the busiest GPU's pairs per step fall by d (load / window_steps, before minus after); the
  step is shorter by d x seconds_per_pair, for horizon_steps steps (the steps until the engine's
  next rebalance);
- stall: each slot that changes loads its expert's bytes, over the link inside a node when a holder
  of that expert is on the slot's node, else over the slower link between nodes (as the agent's
  policy prices a plan: topology.migration_seconds);
- a layer moves when gain > gain_margin x stall and its balancedness rises by min_balancedness_gain;
- a layer whose full mending does not pay tries shorter ones (looser tolerances, SHORTER_TOLERANCES)
  and takes the one with the most gain over its stall, when one pays ("moved less far").

Sizes: L layers, E logical experts, P physical slots, W GPUs (ranks), N nodes.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

import numpy as np

from .. import topology
from .cost import CostModel
from ..checks import is_valid_placement
from .placement_math import contiguous_placement, gpu_load, placement_balancedness
from .incremental import repair_placement
from .solve import solve_placement

SWITCH = "MOEWATCH_EPLB"  # one variable turns moewatch's policy on in vLLM and in SGLang
ENV_PREFIX = "MOEWATCH_EPLB_"

# Why a layer's row is what it is (one per layer in a decision).
MOVED = "moved"
MOVED_LESS = "moved less far: the full mending does not pay for its stall, a looser one does"
KEPT_BALANCED = "kept: no placement better by min_balancedness_gain"
KEPT_NOT_PAYING = "kept: the predicted gain does not pay for the stall"
KEPT_IDLE = "kept: no load"
FRESH = "placed: no usable current placement (first call or a changed slot count)"
# A recorded placement served statically (static_placement.py): no gate, the file's rows.
STATIC_PLACED = "placed: the recorded static placement (MOEWATCH_EPLB_PLACEMENT)"
STATIC_KEPT = "kept: the recorded static placement is in force"
# Short names of the reasons, for metric labels and counts in a record.
OUTCOMES = {MOVED: "moved", MOVED_LESS: "moved_less", FRESH: "placed", KEPT_BALANCED: "kept_no_better",
            KEPT_NOT_PAYING: "kept_not_paying", KEPT_IDLE: "kept_idle", STATIC_PLACED: "placed_static",
            STATIC_KEPT: "kept_static"}
# The reasons of a layer whose row the decision changes.
CHANGED = (MOVED, MOVED_LESS, FRESH, STATIC_PLACED)


# Looser tolerances tried, per layer, when the full mending does not pay for its stall.
SHORTER_TOLERANCES = (0.02, 0.05, 0.1)
# A layer the mending leaves this far under its target balancedness is solved in full (slower).
FULL_SOLVE_BELOW = 0.02


def switched_on(environ: Mapping[str, str]) -> bool:
    """True when MOEWATCH_EPLB asks for moewatch's policy (1, true, yes, on)."""
    return environ.get(SWITCH, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class RebalanceSettings:
    """What the gate prices with; read once per process from MOEWATCH_EPLB_* and identical on every
    rank (the same environment), so every rank decides the same."""

    horizon_steps: float = 3000.0  # steps the new placement serves: vLLM's default step_interval
    window_steps: float = 1000.0  # steps the load was summed over: vLLM's default window_size
    seconds_per_pair: float = CostModel.seconds_per_pair
    expert_bytes: float = 2 * 4096 * 14336 * 3  # the agent's default (bf16, 4096 x 14336, three matrices)
    link_bytes_per_second: float = CostModel.migration_bytes_per_second
    inter_node_bytes_per_second: float = 2.2e10
    gain_margin: float = 1.0
    min_balancedness_gain: float = 0.0
    # The planner stops once a layer's busiest GPU is within this share of the least any placement
    # can give it (incremental.py): moving fewer weights for a little balance.
    tolerance: float = 0.005

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "RebalanceSettings":
        """Settings from MOEWATCH_EPLB_<FIELD> (upper case); raises ValueError naming the variable."""
        values: dict[str, float] = {}
        for f in fields(cls):
            name = ENV_PREFIX + f.name.upper()
            raw = environ.get(name)
            if raw is None or raw == "":
                continue
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"{name}: not a number: {raw!r}") from None
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: must be a finite number >= 0, got {raw!r}")
            values[f.name] = value
        settings = cls(**values)
        for name in ("window_steps", "link_bytes_per_second", "inter_node_bytes_per_second"):
            if getattr(settings, name) <= 0:
                raise ValueError(f"{ENV_PREFIX}{name.upper()}: must be > 0")
        if settings.tolerance >= 1.0 or settings.min_balancedness_gain > 1.0:
            raise ValueError(f"{ENV_PREFIX}TOLERANCE must be < 1 and {ENV_PREFIX}MIN_BALANCEDNESS_GAIN <= 1")
        return settings

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class RebalanceDecision:
    """The placement to run and why each layer's row is what it is."""

    physical_to_logical_map: np.ndarray  # [L, P] int64
    reasons: tuple[str, ...]  # [L] one of the constants above
    balancedness_before: np.ndarray | None  # [L] under the current placement (None without one)
    balancedness_after: np.ndarray  # [L] under the returned placement
    balancedness_proposed: np.ndarray  # [L] under the planner's proposal, before the gate
    experts_moved: np.ndarray  # [L] slots whose expert changes from the current placement
    predicted_gain_seconds: np.ndarray  # [L] over horizon_steps
    predicted_stall_seconds: np.ndarray  # [L] loading the proposal's changed slots
    solve_seconds: float  # reported only; never part of the decision

    def record(self) -> dict[str, Any]:
        """JSON-ready summary of the decision (layers by reason, predicted figures)."""
        by_reason: dict[str, list[int]] = {}
        for layer, reason in enumerate(self.reasons):
            by_reason.setdefault(reason, []).append(layer)
        before = None if self.balancedness_before is None else float(self.balancedness_before.mean())
        moved = sum(self.reasons.count(reason) for reason in CHANGED)
        return {
            "layers_moved": moved,
            "layers_kept": len(self.reasons) - moved,
            "layers_by_reason": by_reason,
            "layer_outcomes": {OUTCOMES[reason]: len(layers) for reason, layers in by_reason.items()},
            "experts_moved": int(self.experts_moved.sum()),
            "balancedness_before": before,
            "balancedness_after": float(self.balancedness_after.mean()),
            "balancedness_proposed": float(self.balancedness_proposed.mean()),
            "predicted_gain_seconds": float(self.predicted_gain_seconds.sum()),
            "predicted_stall_seconds": float(self.predicted_stall_seconds[self._moved_mask()].sum()),
            "solve_seconds": self.solve_seconds,
        }

    def _moved_mask(self) -> np.ndarray:
        return np.array([r in CHANGED for r in self.reasons], dtype=bool)


def usable_current(current: Any, num_layers: int, num_experts: int, num_slots: int,
                   num_gpus: int) -> np.ndarray | None:
    """[L, P] placement in force as int64, or None when it cannot be kept: absent, another slot count
    (the engine scaled), or any slot empty (-1) or out of range."""
    if current is None:
        return None
    arr = np.asarray(current)
    if arr.shape != (num_layers, num_slots) or not np.issubdtype(arr.dtype, np.integer):
        return None
    arr = arr.astype(np.int64)
    return arr if is_valid_placement(arr, num_experts, num_gpus) else None


def gated_rebalance(load: Any, num_slots: int, num_gpus: int, num_nodes: int = 1, current: Any = None,
                    settings: RebalanceSettings = RebalanceSettings()) -> RebalanceDecision:
    """[L, E] load summed over settings.window_steps steps, [L, P] current placement (optional) ->
    RebalanceDecision with an [L, P] int64 placement holding every expert at least once.

    With no usable current placement every layer is placed afresh (nothing to keep). With all-zero
    load the current placement is returned as it is (or the contiguous default without one).
    Raises ValueError (planner.PlacementShapeError) on sizes that do not fit."""
    load_arr = np.asarray(load, dtype=np.float64)
    if load_arr.ndim != 2 or not np.isfinite(load_arr).all() or (load_arr < 0).any():
        raise ValueError(f"load: must be a finite, non-negative [layers, experts] array, got shape {load_arr.shape}")
    L, E = load_arr.shape
    P, W, N = int(num_slots), int(num_gpus), int(num_nodes)
    cur = usable_current(current, L, E, P, W)
    started = time.perf_counter()
    if not load_arr.any():
        pmap = cur.copy() if cur is not None else contiguous_placement(L, E, P).astype(np.int64)
        ones = np.ones(L)
        zeros = np.zeros(L)
        reasons = (KEPT_IDLE,) * L if cur is not None else (FRESH,) * L
        return RebalanceDecision(pmap, reasons, ones if cur is not None else None, ones, ones,
                                 np.zeros(L, dtype=np.int64) if cur is not None else np.full(L, P), zeros, zeros,
                                 time.perf_counter() - started)
    proposed, bal_proposed = propose(load_arr, cur, P, W, N, settings.tolerance)
    if cur is None:
        return RebalanceDecision(proposed, (FRESH,) * L, None, bal_proposed, bal_proposed, np.full(L, P),
                                 np.zeros(L), np.zeros(L), time.perf_counter() - started)
    gain, stall = layer_gain_and_stall(load_arr, cur, proposed, W, N, settings)
    bal_before = placement_balancedness(load_arr, cur, W)
    moved = (proposed != cur).sum(axis=1)
    reasons = []
    for layer in range(L):
        if not load_arr[layer].any():
            reasons.append(KEPT_IDLE)
        elif moved[layer] == 0 or bal_proposed[layer] < bal_before[layer] + max(settings.min_balancedness_gain, 1e-12):
            reasons.append(KEPT_BALANCED)
        elif gain[layer] <= settings.gain_margin * stall[layer]:
            reasons.append(KEPT_NOT_PAYING)
        else:
            reasons.append(MOVED)
    take = np.array([r == MOVED for r in reasons], dtype=bool)
    pmap = np.where(take[:, None], proposed, cur)
    bal_after = np.where(take, bal_proposed, bal_before)
    moved_after = np.where(take, moved, 0)
    unpaid = np.array([r == KEPT_NOT_PAYING for r in reasons], dtype=bool)
    if unpaid.any():
        # A layer whose full mending costs more than it gains may still pay for a shorter one.
        layers = np.flatnonzero(unpaid)
        for layer, (row, bal, layer_gain, layer_stall) in _shorter_mendings_that_pay(load_arr, cur, layers, bal_before,
                                                                                   W, N, settings).items():
            reasons[layer] = MOVED_LESS
            pmap[layer] = row
            bal_after[layer] = bal
            moved_after[layer] = int((row != cur[layer]).sum())
            gain[layer], stall[layer] = layer_gain, layer_stall
    return RebalanceDecision(pmap, tuple(reasons), bal_before, bal_after, bal_proposed, moved_after, gain, stall,
                             time.perf_counter() - started)


def _shorter_mendings_that_pay(load: np.ndarray, current: np.ndarray, layers: np.ndarray, bal_before: np.ndarray,
                               num_gpus: int, num_nodes: int, settings: RebalanceSettings
                               ) -> dict[int, tuple[np.ndarray, float, float, float]]:
    """For each of `layers` whose full mending does not pay: the mending with a looser tolerance
    (SHORTER_TOLERANCES) with the most gain over the stall, when one pays and raises balancedness;
    -> {layer: ([P] row, balancedness, gain, stall)}."""
    best: dict[int, tuple[float, np.ndarray, float, float, float]] = {}
    sub_load, sub_current = load[layers], current[layers]
    for tolerance in SHORTER_TOLERANCES:
        if tolerance <= settings.tolerance:
            continue
        rows = repair_placement(sub_load, sub_current, num_gpus, tolerance, num_nodes).physical_to_logical_map
        gain, stall = layer_gain_and_stall(sub_load, sub_current, rows, num_gpus, num_nodes, settings)
        bal = placement_balancedness(sub_load, rows, num_gpus)
        for i, layer in enumerate(layers):
            net = gain[i] - settings.gain_margin * stall[i]
            if net > 0 and bal[i] >= bal_before[layer] + max(settings.min_balancedness_gain, 1e-12) and (
                    layer not in best or net > best[layer][0]):
                best[int(layer)] = (float(net), rows[i].copy(), float(bal[i]), float(gain[i]), float(stall[i]))
    return {layer: rest for layer, (_, *rest) in best.items()}


def propose(load: np.ndarray, current: np.ndarray | None, num_slots: int, num_gpus: int, num_nodes: int,
            tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """[L, E] load, [L, P] placement in force (None: the engines' contiguous start) -> ([L, P]
    proposal, [L] its balancedness): the placement mended in place (incremental.py); a layer the
    mending leaves more than FULL_SOLVE_BELOW under its target balancedness is solved in full
    (solve_placement, minimal movement from the same start) and keeps the better balanced of the two,
    the full solve mended once more from where it ends."""
    L, E = load.shape
    start = current if current is not None else contiguous_placement(L, E, num_slots).astype(np.int64)
    repaired = repair_placement(load, start, num_gpus, tolerance, num_nodes)
    proposed = repaired.physical_to_logical_map
    balancedness = placement_balancedness(load, proposed, num_gpus)
    target = np.divide(load.sum(axis=1) / num_gpus, repaired.target_max, out=np.ones(L), where=repaired.target_max > 0)
    missed = np.flatnonzero(~repaired.reached & (balancedness < target - FULL_SOLVE_BELOW))
    if missed.size:
        full = solve_placement(load[missed], num_gpus, num_slots, num_nodes, current=start[missed],
                               tolerance=tolerance)
        better = full.balancedness_after > balancedness[missed]
        solved = missed[better]
        # Mended once more from the full solve, a layer stops where the mending would leave it on the
        # next call: on a load that does not change, that call moves nothing.
        again = repair_placement(load[solved], full.physical_to_logical_map[better], num_gpus, tolerance, num_nodes)
        proposed[solved] = again.physical_to_logical_map
        balancedness[solved] = placement_balancedness(load[solved], again.physical_to_logical_map, num_gpus)
    return proposed, balancedness


def layer_gain_and_stall(load: np.ndarray, current: np.ndarray, proposed: np.ndarray, num_gpus: int,
                         num_nodes: int, settings: RebalanceSettings) -> tuple[np.ndarray, np.ndarray]:
    """[L, E] load, [L, P] current and proposed -> ([L] seconds gained over the horizon, [L] seconds
    of stall loading the proposal's changed slots)."""
    busiest_before = gpu_load(load, current, num_gpus).max(axis=1)
    busiest_after = gpu_load(load, proposed, num_gpus).max(axis=1)
    per_step = (busiest_before - busiest_after) / settings.window_steps
    gain = np.maximum(per_step, 0.0) * settings.seconds_per_pair * settings.horizon_steps
    stall = topology.layer_migration_seconds(current, proposed, num_gpus, num_gpus // num_nodes, settings.expert_bytes,
                                             settings.link_bytes_per_second, settings.inter_node_bytes_per_second)
    return gain, stall


class DecisionRecords:
    """The records of an engine's policy calls not yet reported, oldest first, at most `limit` (older
    ones are dropped and counted). Thread-safe: vLLM calls its policy on a background thread."""

    def __init__(self, limit: int = 64):
        self._records: deque[dict[str, Any]] = deque(maxlen=limit)
        self._lock = threading.Lock()
        self.dropped = 0

    def append(self, record: dict[str, Any]) -> None:
        with self._lock:
            if len(self._records) == self._records.maxlen:
                self.dropped += 1
            self._records.append(record)

    def take(self) -> list[dict[str, Any]]:
        """Every pending record, oldest first; the queue is empty afterwards."""
        with self._lock:
            out = list(self._records)
            self._records.clear()
        return out
