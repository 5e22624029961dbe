"""Verifying the engine's own rebalances (moewatch's EPLB policy inside vLLM or SGLang, or the engine's
own policy recorded with moewatch's off): the layers a
rebalance moved, by the records its window carried (extra.engine_rebalance), are compared on the
next window that measures balancedness with the window before the rebalance. Pure: the caller keeps
the pending check between windows and writes the verdict (audit line, counters).

A layer is worse when its measured balancedness fell by more than `drop` (the agent's
rollback_balancedness_drop); the agent cannot undo an engine's rebalance, so a worse layer is
reported, never rolled back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .metrics.engine_rebalance import is_engine_own, record_number

MOVED_PREFIXES = ("moved", "placed")  # the planner's reasons for a layer whose row changed


@dataclass(frozen=True)
class PendingCheck:
    """Layers a rebalance moved and their measured balancedness in the window before it."""

    before: dict[int, float]


def moved_layers(records: Sequence[dict[str, Any]]) -> tuple[int, ...]:
    """Layers any decided record moved (its layers_by_reason under a moved or placed reason, or the
    layers_changed of the engine's own policy's call)."""
    out: set[int] = set()
    for record in records:
        if is_engine_own(record):
            out.update(layer for layer in record["layers_changed"] if isinstance(layer, int) and not isinstance(layer, bool))
            continue
        reasons = record.get("layers_by_reason")
        if record.get("fallback") is True or not isinstance(reasons, dict):
            continue
        for reason, layers in reasons.items():
            if isinstance(reason, str) and reason.startswith(MOVED_PREFIXES) and isinstance(layers, list):
                out.update(layer for layer in layers if isinstance(layer, int) and not isinstance(layer, bool))
    return tuple(sorted(out))


def step(pending: PendingCheck | None, previous: np.ndarray | None, current: np.ndarray | None,
         records: Sequence[dict[str, Any]], drop: float) -> tuple[PendingCheck | None, dict[str, Any] | None]:
    """One triaged window: [L] measured balancedness of the window before (None when unmeasured) and of
    this one, the records it carried -> (the check pending after it, the verdict it settles or None)."""
    verdict = None
    if pending is not None and current is not None:
        layers = [layer for layer in sorted(pending.before) if layer < current.shape[0]]
        after = {layer: float(current[layer]) for layer in layers}
        worse = [layer for layer in layers if after[layer] < pending.before[layer] - drop]
        verdict = {"verdict": "worse" if worse else "not_worse", "layers_checked": layers, "layers_worse": worse,
                   "balancedness_before": {str(k): round(pending.before[k], 4) for k in layers},
                   "balancedness_after": {str(k): round(v, 4) for k, v in after.items()}}
        pending = None
    moved = moved_layers(records)
    if moved and previous is not None:
        before = {layer: float(previous[layer]) for layer in moved if layer < previous.shape[0]}
        if before:
            pending = PendingCheck(before)
    return pending, verdict


def status_after(status: dict[str, Any] | None, records: Sequence[dict[str, Any]], verdict: dict[str, Any] | None,
                 window_end: float) -> dict[str, Any] | None:
    """A group's engine-rebalance status (the agent's /status, `moewatch top`) after one triaged window:
    calls and fallbacks so far, what the latest decided call did, the latest fallback's error, and the
    latest check on a next window. A new dict (the HTTP thread reads the old one meanwhile); None
    while no record has come."""
    if not records and verdict is None:
        return status
    out = dict(status or {"calls": 0, "fallbacks": 0, "checks": 0, "worse": 0})
    for record in records:
        out["calls"] += 1
        out["engine"] = record["engine"]
        if is_engine_own(record):
            out["engine_own"] = out.get("engine_own", 0) + 1
            out["last"] = {
                "window_end": window_end, "policy": "engine_own",
                "layers_moved": float(len(record["layers_changed"])),
                "experts_moved": record_number(record.get("slots_moved")),
                **{key: record_number(record.get(key)) for key in ("balancedness_before", "balancedness_after")},
            }
            continue
        if record.get("fallback") is True:
            out["fallbacks"] += 1
            out["last_fallback"] = {"window_end": window_end, "error": str(record.get("error", ""))[:200]}
            continue
        outcomes = record.get("layer_outcomes") or {}
        out["last"] = {
            "window_end": window_end,
            "layers_moved": record_number(record.get("layers_moved")),
            "layers_kept": record_number(record.get("layers_kept")),
            "layer_outcomes": {k: v for k, v in outcomes.items() if isinstance(k, str) and record_number(v) is not None},
            "experts_moved": record_number(record.get("experts_moved")),
            **{key: record_number(record.get(key))
               for key in ("balancedness_before", "balancedness_after", "predicted_stall_seconds", "solve_seconds")},
        }
    if verdict is not None:
        out["checks"] += 1
        out["worse"] += verdict["verdict"] == "worse"
        out["last_check"] = {"window_end": window_end, "verdict": verdict["verdict"],
                             "layers_worse": list(verdict["layers_worse"])}
    return out
