"""Families the controller writes: its decisions by kind and result, and rollbacks."""

from __future__ import annotations

from moewatch.vocabulary import COUNTED_RESULTS, DECISION_KINDS

from .family import GROUP, Counter, families_of

ACTIONS_TOTAL = Counter(
    "moewatch_actions_total", (*GROUP, "kind", "result"),
    f"Decisions by kind ({', '.join(DECISION_KINDS)}) and result ({', '.join(COUNTED_RESULTS)}).")
ROLLBACKS_TOTAL = Counter("moewatch_rollbacks_total", GROUP, "Plans rolled back after verification.")

FAMILIES = families_of(globals())

# The label values every group's actions counter starts with (at 0, so a first event is an increase).
ACTION_KINDS = DECISION_KINDS
ACTION_RESULTS = COUNTED_RESULTS
