"""Plan: a whole desired state for an EP group, never a delta.

A plan names the placement (physical_to_logical_map [L, P]) and the capacity factor per layer [L]
that the runtime should run from `epoch` on, and optionally the all-to-all's order (`a2a_schedule`,
"none" or "aurora"; absent: keep the one in force, so a plan without it means what it always meant). Runtimes refuse a plan whose epoch is not newer than the
one in force, so sending the same plan twice is harmless (idempotent, fenced by epoch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .checks import check_map_shape, check_placement as check_placement_rule, check_slots_divide
from .errors import InputError


A2A_SCHEDULES = ("none", "aurora")


class PlanError(InputError):
    """A plan broke its contract; `field` names the offending field."""


@dataclass(frozen=True, eq=False)
class Plan:
    epoch: int
    physical_to_logical_map: np.ndarray  # [L, P] int64
    capacity_factor: np.ndarray  # [L] float64; 0 means dropless
    reason: str = ""
    # Extra facts a writer wants to carry (predicted gain, source windows...); round-trips as is.
    meta: dict[str, Any] = field(default_factory=dict)
    # The all-to-all's order from `epoch` on (A2A_SCHEDULES); None keeps the one in force.
    a2a_schedule: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, (int, np.integer)) or self.epoch < 0:
            raise PlanError("epoch", f"must be a non-negative integer, got {self.epoch!r}")
        object.__setattr__(self, "epoch", int(self.epoch))
        pmap = _int_matrix("physical_to_logical_map", self.physical_to_logical_map)
        if np.any(pmap < 0):
            layer, slot = map(int, np.argwhere(pmap < 0)[0])
            raise PlanError("physical_to_logical_map", f"layer {layer} slot {slot}: negative expert id")
        cap = np.asarray(self.capacity_factor, dtype=np.float64) if _numeric(self.capacity_factor) else None
        if cap is None or cap.ndim != 1 or cap.shape[0] != pmap.shape[0]:
            raise PlanError("capacity_factor", f"expected one number per layer ({pmap.shape[0]})")
        if not np.all(np.isfinite(cap)) or np.any(cap < 0):
            raise PlanError("capacity_factor", "must be finite and >= 0 (0 means dropless)")
        pmap.setflags(write=False)
        cap.setflags(write=False)
        object.__setattr__(self, "physical_to_logical_map", pmap)
        object.__setattr__(self, "capacity_factor", cap)
        object.__setattr__(self, "meta", dict(self.meta))
        if self.a2a_schedule is not None and self.a2a_schedule not in A2A_SCHEDULES:
            raise PlanError("a2a_schedule", f"must be one of {', '.join(A2A_SCHEDULES)}, got {self.a2a_schedule!r}")

    @property
    def num_layers(self) -> int:
        return int(self.physical_to_logical_map.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.physical_to_logical_map.shape[1])

    def check_against(self, num_layers: int, num_experts: int, num_slots: int, world_size: int) -> None:
        """Raise PlanError unless the plan fits a runtime of these sizes."""
        pmap = self.physical_to_logical_map
        check_map_shape(pmap, num_layers, num_slots, PlanError)
        check_slots_divide(num_slots, world_size, PlanError, field="physical_to_logical_map")
        check_placement(pmap, num_experts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "physical_to_logical_map": self.physical_to_logical_map.tolist(),
            "capacity_factor": self.capacity_factor.tolist(),
            "reason": self.reason,
            "meta": self.meta,
            # Written only when set: a reader older than the field sees the plan it always saw.
            **({"a2a_schedule": self.a2a_schedule} if self.a2a_schedule is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Any) -> "Plan":
        if not isinstance(data, dict):
            raise PlanError("<root>", "expected an object")
        for key in ("epoch", "physical_to_logical_map", "capacity_factor"):
            if key not in data:
                raise PlanError(key, "missing")
        reason = data.get("reason", "")
        meta = data.get("meta", {})
        if not isinstance(reason, str):
            raise PlanError("reason", "must be a string")
        if not isinstance(meta, dict):
            raise PlanError("meta", "must be an object")
        return cls(data["epoch"], data["physical_to_logical_map"], data["capacity_factor"], reason, meta,
                   data.get("a2a_schedule"))


def check_placement(pmap: np.ndarray, num_experts: int) -> None:
    """Raise PlanError unless every entry of pmap [L, P] is in [0, E) and every expert has a slot."""
    check_placement_rule(pmap, num_experts, PlanError)


def _numeric(value: Any) -> bool:
    try:
        arr = np.asarray(value)
    except ValueError:
        return False
    return arr.dtype.kind in "iuf"


def _int_matrix(name: str, value: Any) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except ValueError:
        raise PlanError(name, "ragged nested list") from None
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise PlanError(name, f"expected a non-empty [layers][slots] matrix, got shape {list(arr.shape)}")
    if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise PlanError(name, "entries must be integers")
    return arr.astype(np.int64)
