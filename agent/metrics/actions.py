"""Families the controller writes: its decisions by kind and result, and rollbacks."""

from __future__ import annotations

from .family import GROUP, Counter, families_of

ACTIONS_TOTAL = Counter(
    "moewatch_actions_total", (*GROUP, "kind", "result"),
    "Decisions by kind (replicate, capacity, placement, rollback) and result "
    "(recommended, applied, skipped, failed, rolled_back).")
ROLLBACKS_TOTAL = Counter("moewatch_rollbacks_total", GROUP, "Plans rolled back after verification.")

FAMILIES = families_of(globals())

# The label values every group's actions counter starts with (at 0, so a first event is an increase).
ACTION_KINDS = ("replicate", "placement", "capacity", "batch", "rollback")
ACTION_RESULTS = ("recommended", "applied", "skipped", "failed", "rolled_back")
