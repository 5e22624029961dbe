"""The capacity factor: how many pairs an expert may take, what overflows at a given C, and the
smallest C whose overflow stays under a target. The one home of this arithmetic: the triage, the
planner, the agent's policy and the runtime all call it.

Definition (GShard's, per rank in the runtime): each expert takes at most C x N x k / E pairs per
step (N tokens, top-k, E experts), that is C times the mean pairs per expert in that step; pairs
beyond it overflow (dropped or re-routed). C = 0 (or below) is dropless: nothing overflows.

Two solves, on two kinds of evidence:
- `mean_load_capacities`: one load per row (a window's routed pairs [E] per layer) taken
  as the shape of every step; exact (the overflow is piecewise linear in C). Window averages
  understate per-step spread, and so C: it is what the triage can say from one window.
- `capacity_for_target`: per-step loads [S, L, E] replayed step by step; the overflow only falls as C
  grows, so a bisection finds the smallest C meeting the target. `capacity_for_windows` feeds it the
  consecutive windows of a group, each window's mean step being one step: what the live policy uses.

Sizes: S steps, L layers, E experts, R rows (layers of one window, or any batch of loads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from .telemetry import Window

_BISECTION_STEPS = 60
PLANNER_ROUNDING = 1e-3  # the planner reports C to three decimals
TRIAGE_ROUNDING = 1e-2  # the triage and the agent to two (for humans)


@dataclass(frozen=True)
class CapacityResult:
    capacity_factor: np.ndarray  # [L] smallest C meeting the target (rounded up)
    overflow_rate: np.ndarray  # [L] overflow replayed at that C
    buffer_pairs: np.ndarray  # [L] capacity buffer, pairs per step (busiest step)
    buffer_bytes: np.ndarray | None  # [L] buffer_pairs x hidden_bytes, when hidden_bytes is given
    tokens_per_step: np.ndarray  # [S] tokens in each step (pairs / top_k, first layer)
    target: float

    def to_dict(self) -> dict:
        return {
            "capacity_factor": self.capacity_factor.tolist(),
            "overflow_rate": self.overflow_rate.tolist(),
            "buffer_pairs": self.buffer_pairs.tolist(),
            "buffer_bytes": None if self.buffer_bytes is None else self.buffer_bytes.tolist(),
            "target": self.target,
        }


def expert_capacity(capacity_factor: float, num_tokens: int, top_k: int, num_experts: int) -> int | None:
    """Pairs one expert may take in a step: ceil(C * N * k / E), or None when dropless (C <= 0)."""
    if capacity_factor <= 0:
        return None
    # Rounding first keeps 1.1 * 320 / 32 from becoming 11.000000000000002 and then 12.
    return math.ceil(round(capacity_factor * num_tokens * top_k / num_experts, 9))


def round_up_capacity(capacity_factor: np.ndarray | float, step: float = TRIAGE_ROUNDING) -> np.ndarray | float:
    """C rounded up to a multiple of `step`, so the overflow target still holds. [any] -> [same]."""
    scale = 1.0 / step
    if np.ndim(capacity_factor) == 0:
        return math.ceil(float(capacity_factor) * scale - 1e-9) / scale
    return np.ceil(np.asarray(capacity_factor) * scale - 1e-9) / scale


def step_overflow_rate(step_loads: np.ndarray, capacity_factor: np.ndarray) -> np.ndarray:
    """[S, L, E] pairs per step, [L] C -> [L] share of pairs over capacity, all steps together
    (0 where C <= 0: dropless, or where nothing was routed)."""
    x = np.asarray(step_loads, dtype=np.float64)
    cap = np.asarray(capacity_factor, dtype=np.float64)
    per_expert_cap = cap[None, :, None] * x.mean(axis=2, keepdims=True)  # [S, L, 1]
    over = np.maximum(x - per_expert_cap, 0.0).sum(axis=(0, 2))
    total = x.sum(axis=(0, 2))
    out = np.zeros_like(total)
    np.divide(over, total, out=out, where=(total > 0) & (cap > 0))
    return out


def mean_load_overflow_rates(expert_load: np.ndarray, capacity_factor: np.ndarray) -> np.ndarray:
    """[R, E] loads, [R] C -> [R] share of routed pairs over capacity (C x mean), each row one step."""
    return step_overflow_rate(np.asarray(expert_load, dtype=np.float64)[None], capacity_factor)


def mean_load_capacities(expert_load: np.ndarray, target: float) -> np.ndarray:
    """Per row, the smallest C (capacity = C x mean expert load) whose overflow share of the routed
    pairs stays at or under `target`, taking the row's shares to hold at every step.
    expert_load: [R, E] (pair counts) -> [R]; 0.0 for an idle row.

    overflow(C) = sum(max(0, load - C*mean)) is piecewise linear and decreasing in C, with breaks at
    the loads: the first break (hottest first) where the overflow passes the budget fixes the piece,
    and C is solved within it."""
    load = -np.sort(-np.asarray(expert_load, dtype=np.float64), axis=1)
    R, E = load.shape
    total, mean = load.sum(axis=1), load.mean(axis=1)
    budget = target * total
    above = np.cumsum(load, axis=1)  # [R, k-1]: pairs of the k hottest experts
    n_over = np.arange(1, E + 1)
    next_level = np.concatenate([load[:, 1:], np.zeros((R, 1))], axis=1)
    passes = (above - n_over * next_level > budget[:, None]) | (n_over == E)
    k = np.argmax(passes, axis=1)
    cap = (above[np.arange(R), k] - budget) / n_over[k]
    out = np.zeros(R)
    np.divide(np.maximum(cap, 0.0), mean, out=out, where=total > 0)
    return out


def capacity_for_target(step_loads: np.ndarray, top_k: int = 1, target: float = 0.01,
                        hidden_bytes: int | None = None, rounding: float = PLANNER_ROUNDING) -> CapacityResult:
    """[S, L, E] pairs per step and expert -> the smallest C per layer with overflow <= target,
    rounded up to `rounding`. The memory it costs is the capacity buffer itself: C x N x k pairs per
    step, at the busiest recorded step, times the bytes a pair carries.

    top_k only converts pairs to tokens for the report; C itself does not depend on it."""
    x = np.asarray(step_loads, dtype=np.float64)
    if x.ndim != 3:
        raise ValueError(f"step_loads: expected [steps, layers, experts], got shape {list(x.shape)}")
    if not np.all(np.isfinite(x)) or np.any(x < 0):
        raise ValueError("step_loads: counts must be finite and >= 0")
    if not 0.0 <= target < 1.0:
        raise ValueError(f"target: must be in [0, 1), got {target}")
    if top_k < 1:
        raise ValueError(f"top_k: must be >= 1, got {top_k}")
    S, L, E = x.shape
    mean = x.mean(axis=2, keepdims=True)
    ratio = np.divide(x, mean, out=np.zeros_like(x), where=mean > 0)
    hi = np.maximum(ratio.max(axis=(0, 2)), 1e-9)  # at C = the largest ratio nothing overflows
    lo = np.zeros(L)
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        meets = step_overflow_rate(x, mid) <= target
        hi = np.where(meets, mid, hi)
        lo = np.where(meets, lo, mid)
    capacity = round_up_capacity(hi, rounding)
    step_pairs = x.sum(axis=2)  # [S, L]
    buffer_pairs = capacity * step_pairs.max(axis=0)
    return CapacityResult(
        capacity_factor=capacity,
        overflow_rate=step_overflow_rate(x, capacity),
        buffer_pairs=buffer_pairs,
        buffer_bytes=None if hidden_bytes is None else buffer_pairs * float(hidden_bytes),
        tokens_per_step=step_pairs[:, 0] / top_k,
        target=float(target),
    )


def capacity_for_windows(windows: Sequence["Window"], layer: int, target: float) -> float:
    """The per-step solve on a group's consecutive windows: each window's routed pairs for `layer`
    divided by its steps is one step of loads [K, E], so the spread between windows counts (one
    window's average would hide it). Windows without per-expert counts are left out; 0.0 when none
    has any. Rounded up to two decimals."""
    rows = [w.expert_tokens[layer] / max(w.steps, 1) for w in windows if w.expert_tokens is not None]
    if not rows:
        return 0.0
    step_loads = np.stack(rows)[:, None, :]  # [K, 1, E]
    return float(capacity_for_target(step_loads, target=target, rounding=TRIAGE_ROUNDING).capacity_factor[0])
