"""Capacity factor: the smallest C per layer whose overflow, replayed on recorded steps, stays under
a target.

Seed 002's definition: each expert takes at most C x N x k / E pairs per step (N tokens, top-k, E
experts), that is C times the mean pairs per expert in that step; pairs beyond it overflow (dropped
or re-routed). Replaying the recorded per-step loads gives the overflow rate at any C; it only falls
as C grows, so a bisection finds the smallest C that meets the target. The memory it costs is the
capacity buffer itself: C x N x k pairs per step, at the busiest recorded step, times the bytes a
pair carries. Loads averaged over a window understate per-step spread (and so C): give per-step
loads when there are any (SGLang's stat dump is [steps, L, E]).

Sizes: S steps, L layers, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_BISECTION_STEPS = 60


@dataclass(frozen=True)
class CapacityResult:
    capacity_factor: np.ndarray  # [L] smallest C meeting the target (rounded up to 1e-3)
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


def overflow_rate(step_loads: np.ndarray, capacity_factor: np.ndarray) -> np.ndarray:
    """[S, L, E] pairs per step, [L] C -> [L] share of pairs over capacity, all steps together."""
    x = np.asarray(step_loads, dtype=np.float64)
    cap = np.asarray(capacity_factor, dtype=np.float64)
    per_expert_cap = cap[None, :, None] * x.mean(axis=2, keepdims=True)  # [S, L, 1]
    over = np.maximum(x - per_expert_cap, 0.0).sum(axis=(0, 2))
    total = x.sum(axis=(0, 2))
    out = np.zeros_like(total)
    np.divide(over, total, out=out, where=total > 0)
    return out


def capacity_for_target(step_loads: np.ndarray, top_k: int = 1, target: float = 0.01,
                        hidden_bytes: int | None = None) -> CapacityResult:
    """[S, L, E] pairs per step and expert -> the smallest C per layer with overflow <= target.

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
        meets = overflow_rate(x, mid) <= target
        hi = np.where(meets, mid, hi)
        lo = np.where(meets, lo, mid)
    capacity = np.ceil(hi * 1000.0 - 1e-9) / 1000.0
    step_pairs = x.sum(axis=2)  # [S, L]
    buffer_pairs = capacity * step_pairs.max(axis=0)
    return CapacityResult(
        capacity_factor=capacity,
        overflow_rate=overflow_rate(x, capacity),
        buffer_pairs=buffer_pairs,
        buffer_bytes=None if hidden_bytes is None else buffer_pairs * float(hidden_bytes),
        tokens_per_step=step_pairs[:, 0] / top_k,
        target=float(target),
    )
