"""The reconcile loop per EP group: observe (triaged windows), decide (policy.py), act (integrations/),
confirm (the Ack's epoch), verify (windows of the new epoch only) and roll back when a layer got worse.

Acting never happens under the controller's lock: a plan is recorded in flight, then handed to the
ActuationWorker (actuation.py), whose outcome comes back through `on_actuation` (an actuator's own
Ack goes on to `on_ack`, as a runtime's does).

State per group, readable on /status: the plan in flight (sent, no Ack yet), the plan under
verification, each layer's last change (cooldown) and the times plans went out (rate limit). At most
one plan is in flight or under verification per group, so every verification compares one change.
Every decision and every step of a plan's life is written to the audit log and counted in
moewatch_actions_total{kind,result}.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from moewatch import telemetry as tm
from moewatch.integrations import registry
from moewatch.integrations.base import Actuation, Actuator
from moewatch.plan import Plan, PlanError
from moewatch.vocabulary import ROLLBACK_APPLIED
from moewatch.wire import Ack

from . import policy, rank_speed, verification
from .actuation import ActuationWorker
from .audit import AuditLog
from .metrics.actions import ACTIONS_TOTAL, ROLLBACKS_TOTAL
from .metrics.rank_speed import record_rank_speed
from .metrics.state import MetricsState
from .params import from_config
from .store import GroupStore, Store, TriagedWindow

log = logging.getLogger("moewatch.agent.controller")


@dataclass
class PlanInFlight:
    plan: Plan
    sent_at: float
    decisions: list[policy.Decision]
    baseline: dict[int, verification.LayerBaseline]
    changed_layers: tuple[int, ...]
    previous_map: np.ndarray  # [L, P] the whole state before, for a rollback
    previous_capacity: np.ndarray  # [L]
    rollback_of: int | None = None  # the epoch this plan undoes
    # The all-to-all order before this plan, when the plan sets one ("none" when the agent never set it:
    # the runtime's default), for a rollback.
    previous_schedule: str | None = None
    # The rank speeds the group's placement was made for before this plan (None: equal speeds), and
    # whether this plan changes the placement and for which speeds.
    speeds_before: np.ndarray | None = None
    changes_placement: bool = False
    planned_speeds: np.ndarray | None = None
    acked_at: float | None = None

    @property
    def kinds(self) -> list[str]:
        return sorted({d.kind for d in self.decisions}) or ["rollback"]


@dataclass
class GroupControl:
    in_flight: PlanInFlight | None = None
    verifying: PlanInFlight | None = None
    last_change: dict[int, float] = field(default_factory=dict)
    plan_times: deque = field(default_factory=lambda: deque(maxlen=10_000))
    recent: deque = field(default_factory=lambda: deque(maxlen=50))  # recent audit entries, for /status
    plans_applied: int = 0
    rollbacks: int = 0
    stall_per_slot: float | None = None  # from the Acks, a moving average
    placed_speeds: np.ndarray | None = None  # [W] the speeds the placement in force was made for (None: equal)
    a2a_schedule: str | None = None  # the all-to-all order an acknowledged plan set (None: the runtime's start)
    # Each rank's measured speed and whether it is persistently slow (rank_speed.py), over every epoch:
    # a device's speed does not depend on the placement.
    speeds: rank_speed.RankSpeedState = field(default_factory=rank_speed.RankSpeedState)


class Controller:
    def __init__(self, cfg, store: Store, metrics: MetricsState, audit: AuditLog, actuator: Actuator,
                 clock: Callable[[], float] = time.time, worker: ActuationWorker | None = None):
        """`worker` runs the applies; by default one whose outcomes come straight to `on_actuation` (the
        daemon passes one whose outcomes take the Ack queue)."""
        self.cfg = cfg
        self.params = from_config(cfg)  # what the policy and verification decide within
        self.store = store
        self.metrics = metrics
        self.audit = audit
        self.actuator = actuator
        self.clock = clock
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self._control: dict[tuple[str, str], GroupControl] = {}
        self._lock = threading.RLock()
        self.worker = worker or ActuationWorker(actuator, self.on_actuation)

    def control(self, key: tuple[str, str]) -> GroupControl:
        with self._lock:
            return self._control.setdefault(key, GroupControl())

    # --- records ------------------------------------------------------------------------------------
    def _record(self, group: GroupStore, event: str, **fields: Any) -> dict[str, Any]:
        entry = self.audit.record(event, model=group.key[0], ep_group=group.key[1], mode=self.cfg.policy.mode, **fields)
        self.control(group.key).recent.append(entry)
        for listener in self.listeners:
            try:
                listener(entry)
            except Exception:  # a display must never break the loop
                log.exception("listener failed")
        return entry

    def _count(self, group: GroupStore, kind: str, result: str, n: int = 1) -> None:
        self.metrics[ACTIONS_TOTAL].inc((*group.key, kind, result), n)
        if (kind, result) == ROLLBACK_APPLIED:
            # The same count under its own name, which alerts and dashboards read: moved only here.
            self.metrics[ROLLBACKS_TOTAL].inc(group.key, n)

    # --- decide and act -----------------------------------------------------------------------------
    def plan_tick(self) -> None:
        """The planning job: run the policy for every connected group."""
        for group in self.store.groups():
            self.plan_group(group)

    def plan_group(self, group: GroupStore, now: float | None = None) -> policy.Proposal | None:
        now = self.clock() if now is None else now
        if self.cfg.policy.mode == "observe" or not group.connected or group.hello is None:
            return None
        ctl = self.control(group.key)
        with self._lock:
            if ctl.in_flight is not None or ctl.verifying is not None:
                return None  # one change at a time: wait for its Ack and its verification
            hello = group.hello
            # What the group declares it takes, as far as the actuator that would apply it can.
            applying = registry.properties_for(hello.runtime, self.actuator)
            view = policy.GroupView(
                num_gpus=hello.world_size, num_nodes=_num_nodes(hello), num_experts=hello.num_experts,
                num_slots=hello.num_slots, capabilities=frozenset(hello.capabilities) & applying.applies,
                actuator=applying,
                windows=group.recent(epoch=group.epoch_in_force), last_change=dict(ctl.last_change),
                plan_times=tuple(ctl.plan_times), observed_stall_per_slot=ctl.stall_per_slot,
                fit_windows=group.recent(),
                rank_speed=rank_speed.steady_speeds(rank_speed.planning_speeds(ctl.speeds), ctl.placed_speeds,
                                                    self.params.rank_speed),
                slow_ranks=ctl.speeds.slow_ranks, placed_for_speeds=ctl.placed_speeds is not None,
                a2a_schedule=ctl.a2a_schedule)
            proposal = policy.decide(view, self.params.policy, now)
            for d in proposal.decisions:
                if d.result in ("skipped", "recommended"):
                    self._count(group, d.kind, d.result)
                self._record(group, "decision", epoch_in_force=group.epoch_in_force, **d.to_dict())
            if proposal.has_plan and self.cfg.policy.mode == "act":
                latest = view.windows[-1].window
                self._send(group, ctl, proposal.physical_to_logical_map, proposal.capacity_factor,
                           proposal.reason, [d for d in proposal.decisions if d.result == "proposed"],
                           proposal.baseline, proposal.changed_layers,
                           np.array(latest.physical_to_logical_map), np.array(latest.capacity_factor), now,
                           a2a_schedule=proposal.a2a_schedule)
            return proposal

    def submit(self, group: GroupStore, physical_to_logical_map: np.ndarray, capacity_factor: np.ndarray,
               reason: str, kind: str = "placement") -> Plan | None:
        """An operator's plan (e.g. `moewatch plan` output): sent, acknowledged, verified and rolled back
        like the policy's own. Refused (None) while another plan is in flight or under verification."""
        ctl = self.control(group.key)
        latest = group.latest()
        if latest is None:
            raise ValueError("no window yet: the state to return to on rollback is unknown")
        with self._lock:
            if ctl.in_flight is not None or ctl.verifying is not None:
                return None
            now = self.clock()
            old_map = np.array(latest.window.physical_to_logical_map)
            old_cap = np.array(latest.window.capacity_factor, dtype=np.float64)
            new_map = np.asarray(physical_to_logical_map, dtype=np.int64)
            changed = tuple(int(x) for x in np.flatnonzero((new_map != old_map).any(axis=1)
                                                           | (np.asarray(capacity_factor) != old_cap)))
            windows = group.recent(epoch=group.epoch_in_force)[-self.cfg.policy.persist_windows:] or [latest]
            baseline = {layer: verification.make_baseline(windows, layer, old_map[layer], float(old_cap[layer]),
                                                    latest.window.world_size) for layer in changed}
            decision = policy.Decision(kind, changed, "proposed", reason)
            self._record(group, "decision", epoch_in_force=group.epoch_in_force, **decision.to_dict())
            return self._send(group, ctl, new_map, np.asarray(capacity_factor, dtype=np.float64), reason,
                              [decision], baseline, changed, old_map, old_cap, now)

    def _send(self, group: GroupStore, ctl: GroupControl, pmap: np.ndarray, cap: np.ndarray, reason: str,
              decisions: list[policy.Decision], baseline: dict[int, verification.LayerBaseline],
              changed: tuple[int, ...], previous_map: np.ndarray, previous_cap: np.ndarray, now: float,
              rollback_of: int | None = None, a2a_schedule: str | None = None) -> Plan | None:
        hello = group.hello
        epoch = group.next_epoch()
        meta = {"source": "moewatch-agent", "changed_layers": list(changed),
                "decisions": [d.to_dict() for d in decisions]}
        if rollback_of is not None:
            meta["rollback_of"] = rollback_of
        try:
            plan = Plan(epoch, pmap, cap, reason, meta, a2a_schedule)
            plan.check_against(hello.num_layers, hello.num_experts, hello.num_slots, hello.world_size)
        except PlanError as exc:  # a planner bug must not reach a runtime
            for d in decisions:
                self._count(group, d.kind, "failed")
            self._record(group, "plan_invalid", epoch=epoch, reason=reason, error=str(exc))
            return None
        flight = PlanInFlight(plan, now, decisions, baseline, changed, previous_map, previous_cap, rollback_of,
                              speeds_before=ctl.placed_speeds,
                              changes_placement=any(d.kind in policy.PLACEMENT_KINDS for d in decisions),
                              planned_speeds=_planned_speeds(baseline),
                              previous_schedule=None if a2a_schedule is None else (ctl.a2a_schedule or "none"))
        ctl.in_flight = flight
        ctl.plan_times.append(now)
        self._record(group, "plan_sent", epoch=epoch, reason=reason, layers=list(changed),
                     kinds=flight.kinds if rollback_of is None else ["rollback"], rollback_of=rollback_of,
                     capacity_factor=[float(cap[i]) for i in changed])
        if not self.worker.submit(group.key, plan):
            self._finish_failed(group, ctl, flight, "not applied: the agent is stopping or too many applies wait")
        return plan

    def on_actuation(self, group_key: tuple[str, str], plan: Plan, actuation: Actuation, seconds: float) -> None:
        """An apply finished (on the worker's thread, or the daemon's Ack thread). An actuator that
        completes by itself answers with its Ack (handled as a runtime's), a failure without one fails
        the plan if it is still in flight, and a plan sent over a connection waits for its Ack."""
        group = self.store.get(group_key)
        if group is None:
            log.info("apply of epoch %d for %s/%s finished after the group was forgotten: %s", plan.epoch,
                     *group_key, actuation.detail)
            return
        ctl = self.control(group_key)
        with self._lock:
            flight = ctl.in_flight
            current = flight is not None and flight.plan.epoch == plan.epoch
            # A plan handed to a runtime ("sent") is audited by its Ack, which may even come first; an
            # apply the actuator finished itself, or a failure after its plan was closed (ack timeout,
            # a new lineage), by this line.
            if actuation.ack is not None or (actuation.status == "failed" and not current):
                self._record(group, "actuation_finished", epoch=plan.epoch,
                             actuator=getattr(self.actuator, "name", ""), status=actuation.status,
                             detail=actuation.detail, seconds=round(seconds, 3), in_flight=current)
            if actuation.ack is not None:
                self.on_ack(group, actuation.ack)
            elif actuation.status == "failed" and current:
                self._finish_failed(group, ctl, flight, actuation.detail)

    # --- confirm ------------------------------------------------------------------------------------
    def on_ack(self, group: GroupStore, ack: Ack, lineage: int | None = None) -> str | None:
        """An Ack from the runtime; returns a rejection reason when it answers no plan in flight, or
        comes from an ended `lineage` (the group's lineage when the Ack arrived; None: the actuator's
        own). An old runtime's Ack must never move a restarted runtime's epoch fence: its windows
        count from epoch 0 again and would all be fenced out as stale."""
        ctl = self.control(group.key)
        with self._lock:
            flight = ctl.in_flight
            if lineage is not None and lineage != group.lineage:
                group.note_epoch(ack.epoch_in_force)
                return "stale_epoch"
            if flight is None or ack.plan_epoch != flight.plan.epoch:
                group.note_epoch(ack.epoch_in_force)
                return "stale_epoch"
            ctl.in_flight = None
            now = self.clock()
            if not ack.ok:
                self._finish_failed(group, ctl, flight, ack.error or "runtime refused the plan", ack)
                return None
            with group.lock:
                group.epoch_in_force = max(group.epoch_in_force, ack.epoch_in_force)
                group.note_epoch(ack.epoch_in_force)
            flight.acked_at = now
            if flight.plan.a2a_schedule is not None:
                ctl.a2a_schedule = flight.plan.a2a_schedule
            if flight.changes_placement:
                ctl.placed_speeds = flight.planned_speeds
            for layer in flight.changed_layers:
                ctl.last_change[layer] = now
            ctl.plans_applied += 1
            # The slots whose expert the plan changed, and when it was sent: the rebalance ledger's (agent/ledger.py).
            changed_slots = int((flight.plan.physical_to_logical_map != flight.previous_map).sum())
            ledger_fields = {"sent_at": flight.sent_at, "applied_at": now, "slots_moved": changed_slots,
                             "bytes_moved": float(changed_slots * self.cfg.cost.expert_bytes)}
            moved = sum(int(d.after.get("slots_moved", 0)) for d in flight.decisions)
            if moved == 0:
                moved = changed_slots
            if moved > 0 and ack.stall_seconds > 0:
                observed = ack.stall_seconds / moved
                ctl.stall_per_slot = observed if ctl.stall_per_slot is None else 0.5 * (ctl.stall_per_slot + observed)
            if flight.rollback_of is not None:
                ctl.rollbacks += 1
                self._record(group, "rolled_back", epoch=flight.plan.epoch, rollback_of=flight.rollback_of,
                             layers=list(flight.changed_layers), stall_seconds=ack.stall_seconds, step=ack.step,
                             **ledger_fields)
                # After the audit line: whoever sees the counters move can read why.
                self._count(group, "rollback", "applied")
                return None
            for d in flight.decisions:
                self._count(group, d.kind, "applied")
            self._record(group, "plan_applied", epoch=flight.plan.epoch, layers=list(flight.changed_layers),
                         kinds=flight.kinds, stall_seconds=ack.stall_seconds, step=ack.step,
                         layers_changed=ack.layers_changed, **ledger_fields,
                         predicted={d.layers[0]: d.after for d in flight.decisions if d.layers})
            if flight.baseline:
                ctl.verifying = flight
            return None

    def _finish_failed(self, group: GroupStore, ctl: GroupControl, flight: PlanInFlight, why: str,
                       ack: Ack | None = None) -> None:
        ctl.in_flight = None
        kinds = ["rollback"] if flight.rollback_of is not None else [d.kind for d in flight.decisions]
        for kind in kinds:
            self._count(group, kind, "failed")
        self._record(group, "plan_failed", epoch=flight.plan.epoch, layers=list(flight.changed_layers),
                     error=why, epoch_in_force=None if ack is None else ack.epoch_in_force)

    def ack_deadline_seconds(self) -> float:
        """How long a plan may stay in flight: ack_timeout_seconds, plus the actuator's own bound on an
        apply when it has one (an SGLang command's timeout: a rolling restart is not a lost Ack)."""
        return self.cfg.verify.ack_timeout_seconds + float(getattr(self.actuator, "timeout_seconds", 0.0) or 0.0)

    def check_timeouts(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        limit = self.ack_deadline_seconds()
        for group in self.store.groups():
            ctl = self.control(group.key)
            with self._lock:
                flight = ctl.in_flight
                if flight is not None and now - flight.sent_at > limit:
                    self._finish_failed(group, ctl, flight, f"no Ack within {limit:g} s")

    def abandon(self, group: GroupStore, why: str) -> None:
        """The runtime this group's plans were for is gone (a new lineage, or the group retired): a plan
        in flight or under verification can never finish. Close it as abandoned (audited, counted) so
        the policy acts again for the new runtime; its cooldowns were about the old runtime's placement."""
        ctl = self.control(group.key)
        with self._lock:
            for state, flight in (("in_flight", ctl.in_flight), ("verifying", ctl.verifying)):
                if flight is None:
                    continue
                for kind in (["rollback"] if flight.rollback_of is not None else [d.kind for d in flight.decisions]):
                    self._count(group, kind, "abandoned")
                self._record(group, "plan_abandoned", epoch=flight.plan.epoch, layers=list(flight.changed_layers),
                             state=state, reason=why)
            ctl.in_flight = ctl.verifying = None
            ctl.last_change.clear()
            ctl.speeds = rank_speed.RankSpeedState()  # the new runtime may run on other devices
            ctl.placed_speeds = None  # and starts from its own placement

    def forget(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._control.pop(key, None)

    # --- verify -------------------------------------------------------------------------------------
    def on_window(self, group: GroupStore, triaged: TriagedWindow) -> None:
        """After each triaged window: fold it into the ranks' speeds, then verify the plan under
        verification on its own epoch's windows."""
        ctl = self.control(group.key)
        with self._lock:
            self._observe_rank_speed(group, ctl, triaged.window)
            flight = ctl.verifying
            if flight is None or triaged.window.epoch != flight.plan.epoch:
                return
            windows = group.recent(epoch=flight.plan.epoch)
            outcome = verification.verify(flight.baseline, windows, self.params.verify, triaged.window.world_size)
            if outcome.status == "wait":
                return
            ctl.verifying = None
            if outcome.status == "keep":
                self._record(group, "verified", epoch=flight.plan.epoch, layers=list(flight.changed_layers),
                             reason=outcome.reason, numbers=outcome.numbers)
                return
            for d in flight.decisions:
                self._count(group, d.kind, "rolled_back")
            self._record(group, "rollback", epoch=flight.plan.epoch, layers=list(outcome.worse_layers),
                         reason=outcome.reason, numbers=outcome.numbers)
            now = self.clock()
            # The whole previous state goes back, with a new epoch (epochs only move forward).
            for layer in flight.changed_layers:
                ctl.last_change[layer] = now
            latest = triaged.window
            self._send(group, ctl, flight.previous_map, flight.previous_capacity,
                       f"rollback of epoch {flight.plan.epoch}: {outcome.reason}", [], {},
                       flight.changed_layers, np.array(latest.physical_to_logical_map),
                       np.array(latest.capacity_factor), now, rollback_of=flight.plan.epoch,
                       a2a_schedule=flight.previous_schedule)
            if ctl.in_flight is not None and ctl.in_flight.rollback_of == flight.plan.epoch:
                # The old placement comes back, and with it what it was made for.
                ctl.in_flight.changes_placement = True
                ctl.in_flight.planned_speeds = flight.speeds_before

    def _observe_rank_speed(self, group: GroupStore, ctl: GroupControl, window) -> None:
        """Each rank's speed from this window (in every mode: it is exported and audited); a rank that
        becomes slow or recovers is audited as `rank_slow` / `rank_recovered`."""
        speed, load = tm.rank_speed(window), tm.rank_load(window)
        if speed is None or load is None:
            return  # a window without compute times or rank counts measures no speed
        params = self.params.rank_speed
        ctl.speeds, change = rank_speed.observe(ctl.speeds, speed, load.sum(axis=0),
                                                 window.end_time - window.start_time, params)
        record_rank_speed(self.metrics, group.key, ctl.speeds)
        relative, rate = ctl.speeds.relative_speed, ctl.speeds.pairs_per_second
        for event, ranks, threshold in (("rank_slow", change.became_slow, params.slow_below),
                                        ("rank_recovered", change.recovered, params.recover_above)):
            for rank in ranks:
                self._record(group, event, rank=rank, relative_speed=round(float(relative[rank]), 4),
                             pairs_per_second=round(float(rate[rank]), 1), threshold=threshold,
                             windows=params.windows, min_seconds=params.min_seconds,
                             slow_ranks=list(ctl.speeds.slow_ranks),
                             epoch_in_force=window.epoch)

    def status(self, key: tuple[str, str]) -> dict[str, Any]:
        ctl = self.control(key)
        with self._lock:
            def brief(f: PlanInFlight | None) -> dict[str, Any] | None:
                if f is None:
                    return None
                return {"epoch": f.plan.epoch, "layers": list(f.changed_layers), "kinds": f.kinds,
                        "reason": f.plan.reason, "sent_at": f.sent_at, "acked_at": f.acked_at,
                        "rollback_of": f.rollback_of}
            return {"in_flight": brief(ctl.in_flight), "verifying": brief(ctl.verifying),
                    "plans_applied": ctl.plans_applied, "rollbacks": ctl.rollbacks,
                    "observed_stall_per_slot_seconds": ctl.stall_per_slot,
                    "rank_relative_speed": [None if not np.isfinite(x) else round(float(x), 4)
                                            for x in ctl.speeds.relative_speed],
                    "slow_ranks": list(ctl.speeds.slow_ranks),
                    "layers_in_cooldown": sorted(layer for layer, t in ctl.last_change.items()
                                                 if self.clock() - t < self.cfg.policy.cooldown_seconds),
                    "recent": list(ctl.recent)[-20:]}


def _num_nodes(hello) -> int:
    per_node = hello.ranks_per_node or hello.world_size
    return max(1, hello.world_size // per_node) if hello.world_size % per_node == 0 else 1



def _planned_speeds(baseline: dict[int, verification.LayerBaseline]) -> np.ndarray | None:
    """The rank speeds a plan's placement was made for (None: equal speeds)."""
    return next((b.rank_speed for b in baseline.values() if b.rank_speed is not None), None)
