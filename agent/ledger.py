"""The rebalance ledger in the agent: one moewatch.ledger.Ledger per EP group, fed each triaged window
(the engine's rebalance records ride in them) and each plan the controller applied (its audit
entries plan_applied / rolled_back, which say when the plan was sent, the slots it moved and the
runtime's measured wait). Each entry it settles is audited ("rebalance_ledger"), exported
(agent/metrics/ledger.py) and summarised for /status and `moewatch top`.

Windows come on the triage job's thread and plans on the Ack thread: one lock around the ledgers.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from moewatch.ledger import AppliedPlan, Ledger, add_window_of
from moewatch.telemetry import Window

from .audit import AuditLog
from .metrics.ledger import init_group, record_entry
from .metrics.state import MetricsState

log = logging.getLogger("moewatch.agent.ledger")

PLAN_EVENTS = ("plan_applied", "rolled_back")  # the controller's audit events of a plan now in force


def applied_plan(entry: dict[str, Any], engine: str = "") -> AppliedPlan | None:
    """The AppliedPlan of a controller audit entry (plan_applied or rolled_back), None for any other or
    one without the fields the ledger needs."""
    if entry.get("event") not in PLAN_EVENTS or entry.get("sent_at") is None or entry.get("slots_moved") is None:
        return None
    return AppliedPlan(epoch=int(entry["epoch"]), sent_at=float(entry["sent_at"]), applied_at=float(entry.get("applied_at", entry["time"])),
                       layers_changed=tuple(int(x) for x in entry.get("layers") or ()),
                       slots_moved=int(entry["slots_moved"]), bytes_moved=entry.get("bytes_moved"),
                       between_steps_stall_seconds=float(entry.get("stall_seconds") or 0.0),
                       rollback_of=entry.get("rollback_of"), engine=engine)


def status_after(status: dict[str, Any] | None, entry: dict[str, Any]) -> dict[str, Any]:
    """A group's ledger summary for /status after one settled entry: counts by outcome and the latest
    entry's figures. A new dict (the HTTP thread reads the old one meanwhile)."""
    out = dict(status or {"entries": 0, "paid": 0, "did_not_pay": 0, "unknown": 0})
    out["entries"] += 1
    out[entry["outcome"]] = out.get(entry["outcome"], 0) + 1
    out["last"] = {k: entry.get(k) for k in (
        "rebalanced_at", "policy", "engine", "layers_changed", "slots_moved", "bytes_moved", "balancedness_before",
        "balancedness_after", "step_seconds_before", "step_seconds_after", "stall_seconds",
        "gain_seconds_per_step", "net_seconds", "horizon_steps", "horizon", "break_even_steps", "outcome")}
    return out


class RebalanceLedgers:
    def __init__(self, metrics: MetricsState, audit: Callable[[], AuditLog | None], windows: int):
        self.metrics = metrics
        self.audit = audit
        self.windows = windows
        self._ledgers: dict[tuple[str, str], Ledger] = {}
        self._status: dict[tuple[str, str], dict[str, Any]] = {}
        self._last_outcome: dict[tuple[tuple[str, str], str], str] = {}  # (group, policy) -> latest outcome
        self._lock = threading.Lock()
        # Called with (group, entry) for each settled entry, after it is audited and exported (the demo
        # prints them); a failing listener is logged, never stops the ledger.
        self.listeners: list[Callable[[tuple[str, str], dict[str, Any]], None]] = []

    def on_window(self, group: tuple[str, str], window: Window) -> list[dict[str, Any]]:
        with self._lock:
            settled = add_window_of(self._ledger(group), window)
            self._settled(group, settled)
        return settled

    def on_control_entry(self, entry: dict[str, Any], engine: str = "") -> list[dict[str, Any]]:
        """A controller audit entry (Controller.listeners): a plan now in force joins its group's ledger."""
        plan = applied_plan(entry, engine)
        if plan is None:
            return []
        group = (entry["model"], entry["ep_group"])
        with self._lock:
            settled = self._ledger(group).add_plan(plan)
            self._settled(group, settled)
        return settled

    def status(self, group: tuple[str, str]) -> dict[str, Any] | None:
        return self._status.get(group)

    def forget(self, group: tuple[str, str]) -> None:
        with self._lock:
            self._ledgers.pop(group, None)
            self._status.pop(group, None)
            for key in [k for k in self._last_outcome if k[0] == group]:
                del self._last_outcome[key]

    def _ledger(self, group: tuple[str, str]) -> Ledger:
        ledger = self._ledgers.get(group)
        if ledger is None:
            ledger = self._ledgers[group] = Ledger(self.windows)
            init_group(self.metrics, group)
        return ledger

    def _settled(self, group: tuple[str, str], entries: list[dict[str, Any]]) -> None:
        audit = self.audit()
        for entry in entries:
            record_entry(self.metrics, group, entry)
            self._status[group] = status_after(self._status.get(group), entry)
            if audit is not None:
                audit.record("rebalance_ledger", model=group[0], ep_group=group[1], **entry)
            for listener in self.listeners:
                try:
                    listener(group, entry)
                except Exception:
                    log.exception("ledger listener failed")
            # One line when a policy's rebalances stop paying, not one per rebalance (the audit has each).
            previous = self._last_outcome.get((group, entry["policy"]))
            self._last_outcome[(group, entry["policy"])] = entry["outcome"]
            if entry["outcome"] == "did_not_pay" and previous != "did_not_pay":
                log.info("group %s/%s: a rebalance by %s did not pay: stall %s s, gain %s s/step, net %s s over %s "
                         "steps (later ones that do not pay are only audited, until one pays)", *group,
                         entry["policy"], _round(entry["stall_seconds"]), _round(entry["gain_seconds_per_step"], 6),
                         _round(entry["net_seconds"]), entry["horizon_steps"])


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)
