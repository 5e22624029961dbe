"""Decisions only: what the agent would change, and whether it should. No sockets, no files, no clocks
(the caller passes `now`), so every rule is testable on simulated windows.

`decide(view, params, now)` runs the guardrails in order, per layer (`params`: PolicyParams):
1. persistence: the layer's verdict (or its overflow flag) held for the last K windows of the epoch
   in force (older epochs never count: the fence);
2. a lever exists: `batch` is the operator's to change, the runtime must advertise `plan` (placement)
   or `capacity`;
3. cooldown: a layer changed less than `cooldown_seconds` ago is left alone;
4. the planner proposes (replica counts within the runtime's fixed slots and `max_replicas_per_expert`,
   packed onto GPUs, aligned to the current placement so as few slots as possible change);
5. the cost gate: the model's balancedness must rise by `min_balancedness_gain`, and the predicted
   seconds saved over `horizon_seconds` must beat the predicted migration stall of the slots that
   change (the larger of the cost model's and what the runtime's Acks reported per slot moved);
   while a rank is persistently slow (`GroupView.rank_speed`, from rank_speed.py) the planner places
   for the measured speeds and the gate reads balancedness by time (pairs over speed), which such a
   plan raises while plain balancedness falls;
6. capacity factor within [capacity_factor_min, capacity_factor_max]; lossy caps only when allowed;
7. the global rate limit on plans per hour.
Whatever passes is folded into one whole Plan (every layer's map and capacity factor), the rest is
reported as skipped with its reason and numbers. The placement maths is the planner's
(`solve_placement` with the replica cap); judging a plan after its Ack is verification.py's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from moewatch import topology
from moewatch.capacity import capacity_for_windows
from moewatch.integrations.base import ActuatorProperties
from moewatch.planner import cost
from moewatch.planner import placement_math as pm
from moewatch.vocabulary import DECISION_KINDS

from .evidence import computed_load, mean_metric, measured, persistent_overflow, persistent_verdicts, steps_per_second
from .rank_speed import rank_seconds, time_balancedness
from .store import TriagedWindow
from .verification import LayerBaseline, make_baseline

PLACEMENT_KINDS = ("replicate", "placement")
KINDS = DECISION_KINDS


@dataclass(frozen=True)
class CostParams:
    """What moving weights costs (the `cost` section); an actuator's own apply cost is in GroupView.actuator."""

    expert_bytes: int
    migration_bandwidth_bytes_per_second: float
    inter_node_bandwidth_bytes_per_second: float


@dataclass(frozen=True)
class PolicyParams:
    """What the policy needs of the configuration (the `policy` section and the costs), built once by
    params.from_config."""

    mode: str  # observe | recommend | act
    persist_windows: int
    horizon_seconds: float
    gain_margin: float
    min_balancedness_gain: float
    cooldown_seconds: float
    max_plans_per_hour: int
    max_replicas_per_expert: int
    capacity_factor_min: float
    capacity_factor_max: float
    allow_lossy_capacity: bool
    cost: CostParams
    # From the triage thresholds: the overflow the capacity action aims under, and its highest factor.
    overflow_target: float = 0.01
    max_capacity_factor: float = 2.0


@dataclass(frozen=True)
class Decision:
    kind: str  # replicate | placement | capacity | batch | rollback
    layers: tuple[int, ...]
    result: str  # recommended | proposed | skipped
    reason: str
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "layers": list(self.layers), "result": self.result, "reason": self.reason,
                "before": self.before, "after": self.after}


@dataclass(frozen=True)
class Proposal:
    decisions: list[Decision]
    physical_to_logical_map: np.ndarray | None = None  # [L, P] whole desired state, when anything passed
    capacity_factor: np.ndarray | None = None  # [L]
    changed_layers: tuple[int, ...] = ()
    baseline: dict[int, LayerBaseline] = field(default_factory=dict)
    reason: str = ""
    a2a_schedule: str | None = None  # the all-to-all order the plan sets (None: keeps the one in force)

    @property
    def has_plan(self) -> bool:
        return self.physical_to_logical_map is not None


@dataclass(frozen=True)
class GroupView:
    """What the policy sees of one EP group."""

    num_gpus: int
    num_nodes: int
    num_experts: int
    num_slots: int
    capabilities: frozenset[str]
    windows: Sequence[TriagedWindow]  # of the epoch in force, oldest first
    last_change: dict[int, float] = field(default_factory=dict)  # layer -> time of its last change
    plan_times: Sequence[float] = ()  # times plans were sent (rate limit)
    # Stall per moved slot the runtime reported in its Acks (None until one arrives): the cost gate
    # takes the larger of this and the model's figure, so a model that flatters migration is corrected.
    observed_stall_per_slot: float | None = None
    # Windows the cost model is fitted to (every epoch: its parameters are the hardware's); default: `windows`.
    fit_windows: Sequence[TriagedWindow] = ()
    # What the actuator that would apply this group's plans declares (an engine that takes none says why).
    actuator: ActuatorProperties = ActuatorProperties()
    # [W] measured relative speeds while a rank is persistently slow (rank_speed.planning_speeds), else
    # None: the planner places for equal speeds (an even split).
    rank_speed: np.ndarray | None = None
    slow_ranks: tuple[int, ...] = ()  # the ranks counted persistently slow
    # The placement in force was made for rank speeds: when none is slow any more, every layer is
    # re-planned for equal speeds (back towards an even split).
    placed_for_speeds: bool = False
    # The all-to-all order in force as far as the agent knows (a plan it had acknowledged set it);
    # None: the runtime's own start.
    a2a_schedule: str | None = None

    @property
    def speed_replan(self) -> bool:
        """Every layer is a placement candidate: a rank is slow, or the speeds the placement was made
        for no longer hold."""
        return self.rank_speed is not None or self.placed_for_speeds


def proposed_placement(load: np.ndarray, current: np.ndarray, num_gpus: int, num_nodes: int,
                       max_replicas: int, rank_speed: np.ndarray | None = None) -> np.ndarray:
    """[L, E] load, [L, P] current placement -> [L, P] the planner's movement-aware placement, with no
    expert in more than `max_replicas` slots; rank_speed [W]: place in proportion to these relative
    speeds (None: equal speeds)."""
    from moewatch.planner.solve import solve_placement  # the planner's scipy loads on first use

    speeds = {} if rank_speed is None else {"rank_speed": [float(x) for x in rank_speed]}
    return np.array(solve_placement(load, num_gpus, current.shape[1], num_nodes, current=current,
                                    max_replicas=max_replicas, **speeds).physical_to_logical_map)


def fitted_cost_model(windows: Sequence[TriagedWindow], migration_bandwidth: float) -> cost.CostModel:
    """The planner's cost model fitted to the group's windows (the defaults when the fit fails)."""
    return cost.fit_or_default([t.window for t in windows],
                               cost.CostModel(migration_bytes_per_second=migration_bandwidth))


# --- decide -------------------------------------------------------------------------------------------

def decide(view: GroupView, params: PolicyParams, now: float) -> Proposal:
    """The guardrails above, for one group, within `params` (mode, K, cooldown, bounds, costs)."""
    if not view.actuator.accepts_plans and params.mode != "observe":
        return _recommend_only(view, params, now, view.actuator.observe_only_reason)
    return _decide(view, params, now)


def _decide(view: GroupView, params: PolicyParams, now: float) -> Proposal:
    windows = list(view.windows)
    k = params.persist_windows
    if params.mode == "observe" or len(windows) < k:
        return Proposal([])
    evidence = windows[-k:]
    latest = evidence[-1].window
    current_map = np.array(latest.physical_to_logical_map)
    current_cap = np.array(latest.capacity_factor, dtype=np.float64)
    decisions, placement_layers, capacity_values = choose_levers(view, params, evidence, now)
    placed, placement_decisions = placement_proposals(view, params, evidence, placement_layers, current_map)
    capped, capacity_decisions = capacity_proposals(params, evidence, capacity_values, current_cap)
    scheduled, schedule_decisions = schedule_proposals(view, params, evidence, now)
    pending = placement_decisions + capacity_decisions + schedule_decisions
    decisions += [d for d in pending if d.result == "skipped"]
    pending = [d for d in pending if d.result == "proposed"]
    if not pending:
        return Proposal(decisions)
    recent = [t for t in view.plan_times if now - t < 3600.0]
    if params.mode == "act" and len(recent) >= params.max_plans_per_hour:
        decisions += [Decision(d.kind, d.layers, "skipped", f"rate limit: {len(recent)} plans in the last hour "
                               f"(max {params.max_plans_per_hour}); would have: {d.reason}", d.before, d.after)
                      for d in pending]
        return Proposal(decisions)
    if params.mode == "act" and "rank_load" in latest.missing_evidence:
        # Verification and rollback judge a change by measured rank load: without it a live change
        # could not be checked, so it stays a recommendation.
        decisions += [Decision(d.kind, d.layers, "recommended", d.reason + "; not applied: the windows carry no "
                               "rank-level counts, so the change could not be verified", d.before, d.after)
                      for d in pending]
        return Proposal(decisions)
    result = "recommended" if params.mode == "recommend" else "proposed"
    decisions += [Decision(d.kind, d.layers, result, d.reason, d.before, d.after) for d in pending]
    new_map, new_cap = current_map.copy(), current_cap.copy()
    kinds: dict[int, str] = {}
    for layer, (row, kind) in placed.items():
        new_map[layer] = row
        kinds[layer] = kind
    for layer, value in capped.items():
        new_cap[layer] = value
        kinds.setdefault(layer, "capacity")
    for layer in scheduled:
        kinds.setdefault(layer, "schedule")
    # A layer placed for rank speeds is verified by time only (verification.py).
    baseline = {layer: make_baseline(evidence, layer, current_map[layer], float(current_cap[layer]), view.num_gpus,
                                     view.rank_speed if layer in placed else None)
                for layer in kinds}
    summary = "; ".join(f"layer {layer}: {kind}" for layer, kind in sorted(kinds.items()))
    if placed and view.rank_speed is not None:
        summary += " (placed for rank speeds " + "/".join(f"{x:.2f}" for x in view.rank_speed) + ")"
    schedule = "aurora" if scheduled and result == "proposed" else None
    return Proposal(decisions, new_map, new_cap, tuple(sorted(kinds)), baseline, summary, schedule)


def schedule_proposals(view: GroupView, params: PolicyParams, evidence: Sequence[TriagedWindow], now: float
                       ) -> tuple[tuple[int, ...], list[Decision]]:
    """The all-to-all order as a lever: layers whose comm-bound / volume verdict held for the last K
    windows and whose triage asks for `schedule` (the window carried the bound, and the time is far
    above it). The order is the group's, not a layer's: one plan field switches every layer, and the
    layers that asked are the ones verification judges. Returns (those layers, their decisions)."""
    if view.a2a_schedule == "aurora":
        return (), []
    k = len(evidence)
    latest = evidence[-1].diagnosis
    verdicts = persistent_verdicts(evidence, k)
    layers, decisions = [], []
    for layer, (verdict, cause) in sorted(verdicts.items()):
        action = next((a for a in latest.layers[layer].actions if a.kind == "schedule"), None)
        if action is None:
            continue
        numbers = {"a2a_over_bound": latest.layers[layer].metrics["a2a_over_bound"],
                   "a2a_share": latest.layers[layer].metrics["a2a_share"]}
        since = view.last_change.get(layer)
        if "schedule" not in view.capabilities:
            decisions.append(Decision("schedule", (layer,), "skipped", f"{_label(verdict, cause)}: the runtime "
                                      "does not take an all-to-all order", numbers))
        elif since is not None and now - since < params.cooldown_seconds:
            decisions.append(Decision("schedule", (layer,), "skipped", f"{_label(verdict, cause)}: layer in cooldown "
                                      f"for another {params.cooldown_seconds - (now - since):.0f} s", numbers))
        else:
            layers.append(layer)
            decisions.append(Decision("schedule", (layer,), "proposed", f"{_label(verdict, cause)}: {action.summary}",
                                      numbers, {"a2a_schedule": "aurora",
                                                "predicted_gain": round(float(action.predicted_gain or 0.0), 4)}))
    return tuple(layers), decisions


def _recommend_only(view: GroupView, params: PolicyParams, now: float, note: str) -> Proposal:
    """The decisions for an engine that applies no plan: the planner still says what it would change
    (as if placement were a lever), every such decision is a recommendation naming why, and no plan
    leaves the agent, whatever the mode."""
    view = dataclasses.replace(view, capabilities=view.capabilities | {"plan"})
    proposal = _decide(view, dataclasses.replace(params, mode="recommend"), now)
    return Proposal([Decision(d.kind, d.layers, d.result, f"{d.reason} ({note})", d.before, d.after)
                     for d in proposal.decisions])


def _label(verdict: str, cause: str | None) -> str:
    return verdict + (f"/{cause}" if cause else "")


def _speed_label(view: GroupView) -> str:
    """Why a layer without a verdict of its own is re-placed: the ranks' measured speeds."""
    if view.rank_speed is None:
        return "no rank slow any more (equal speeds again)"
    slow = view.slow_ranks
    return f"slow rank{'s' if len(slow) > 1 else ''} {', '.join(map(str, slow))} (relative speed " + \
        ", ".join(f"{view.rank_speed[r]:.2f}" for r in slow) + ")"


def choose_levers(view: GroupView, params: PolicyParams, evidence: Sequence[TriagedWindow], now: float
                  ) -> tuple[list[Decision], dict[int, str], dict[int, tuple[float, bool]]]:
    """Steps 1-3: which layers have a persistent verdict and a lever the agent may pull.
    Returns (skipped or recommend-only decisions, {layer: placement kind}, {layer: (capacity, lossy)})."""
    k = len(evidence)
    latest = evidence[-1].diagnosis
    verdicts = persistent_verdicts(evidence, k)
    overflowing = persistent_overflow(evidence, k)
    decisions: list[Decision] = []
    placement: dict[int, str] = {}
    capacity: dict[int, tuple[float, bool]] = {}

    def skip(kind: str, layer: int, reason: str) -> None:
        m = latest.layers[layer].metrics
        numbers = {"balancedness": measured(evidence, layer, "balancedness"),
                   "a2a_share": m["a2a_share"], "rank_load_max_mean": m["rank_load_max_mean"],
                   "overflow_rate": m["overflow_rate"], "hot_experts": m["hot_experts"]}
        decisions.append(Decision(kind, (layer,), "skipped", reason, numbers))

    for layer in sorted(set(verdicts) | set(overflowing)):
        diag = latest.layers[layer]
        label = (_label(*verdicts[layer]) if layer in verdicts else "overflow") + \
            (" with overflow" if layer in verdicts and layer in overflowing else "")
        first = {kind: next((a for a in diag.actions if a.kind == kind and not a.params.get("lossy")), None)
                 for kind in ("replicate", "placement", "capacity", "batch")}
        lossy_cap = next((a for a in diag.actions if a.kind == "capacity" and a.params.get("lossy")), None)
        since = view.last_change.get(layer)
        if since is not None and now - since < params.cooldown_seconds:
            skip(next((a.kind for a in diag.actions), "placement"), layer,
                 f"{label}: layer in cooldown for another {params.cooldown_seconds - (now - since):.0f} s")
            continue
        if layer in verdicts and "expert_load" in diag.missing:
            # Per-rank totals show the imbalance; which experts to replicate or move needs their load.
            skip("placement", layer, f"{label} for {k} windows, but no plan: the windows carry per-rank totals "
                 "without per-expert counts (expert_tokens), so no replica or placement can be computed; "
                 "add a source with per-expert counts (an engine's in-process hook or its expert-distribution dumps, "
                 "docs/integrations.md)")
        elif layer in verdicts:
            lever = first["replicate"] or first["placement"]
            if lever is not None:
                if "plan" in view.capabilities:
                    placement[layer] = lever.kind
                else:
                    skip(lever.kind, layer, f"{label}: the runtime does not apply placement plans")
            elif first["batch"] is not None:
                action = first["batch"]
                decisions.append(Decision(
                    "batch", (layer,), "recommended" if params.mode == "recommend" else "skipped",
                    f"{label}: {action.summary}" + ("" if params.mode == "recommend"
                                                    else " The batch is the operator's to change."),
                    {"a2a_share": diag.metrics["a2a_share"], "mean_message_bytes": diag.metrics["mean_message_bytes"]},
                    {"predicted_gain": round(action.predicted_gain, 4)}))
            elif lossy_cap is not None and layer not in overflowing:
                if not params.allow_lossy_capacity:
                    skip("capacity", layer, f"{label}: the only action is a lossy cap at capacity factor "
                         f"{lossy_cap.params['value']:g} (drops pairs); set policy.allow_lossy_capacity to allow it")
                elif "capacity" in view.capabilities:
                    capacity[layer] = (float(lossy_cap.params["value"]), True)
                else:
                    skip("capacity", layer, f"{label}: the runtime does not take a capacity factor")
            else:
                skip("placement", layer, f"{label} for {k} windows but the triage names no action to take")
        if layer in overflowing and first["capacity"] is not None:
            if "capacity" in view.capabilities:
                # The per-step solve over the evidence windows: one window's average understates C.
                wanted = capacity_for_windows([e.window for e in evidence], layer, params.overflow_target)
                capacity[layer] = (min(wanted, params.max_capacity_factor), False)
            else:
                skip("capacity", layer, f"{label}: the runtime does not take a capacity factor")
    if view.speed_replan and "plan" in view.capabilities:
        # A slow rank is the device's, not one layer's verdict: every layer is re-placed for the measured
        # speeds (once it recovered, back towards an even split), each through the same cost gate, which
        # leaves a layer alone when the planner finds nothing better.
        for layer in range(len(latest.layers)):
            since = view.last_change.get(layer)
            if (layer in placement or "expert_load" in latest.layers[layer].missing
                    or (since is not None and now - since < params.cooldown_seconds)):
                continue
            placement[layer] = "placement"
    return decisions, placement, capacity


def placement_proposals(view: GroupView, params: PolicyParams, evidence: Sequence[TriagedWindow], layers: dict[int, str],
                        current_map: np.ndarray) -> tuple[dict[int, tuple[np.ndarray, str]], list[Decision]]:
    """Steps 4-5 for the layers that want a placement change: the planner's proposal, through the
    cost gate. Returns ({layer: (new [P] row, kind)}, proposed and skipped decisions)."""
    if not layers:
        return {}, []
    k = len(evidence)
    latest = evidence[-1]
    verdicts = persistent_verdicts(evidence, k)
    load = computed_load(evidence)
    speed = view.rank_speed
    proposed = proposed_placement(load, current_map, view.num_gpus, view.num_nodes, params.max_replicas_per_expert,
                                  speed)
    # With a slow rank, balancedness by time is the gate's figure: a plan in proportion to speed
    # unbalances pairs on purpose. With equal speeds the two are the same.
    model_before = time_balancedness(pm.gpu_load(load, current_map, view.num_gpus), speed)
    model_after = time_balancedness(pm.gpu_load(load, proposed, view.num_gpus), speed)
    moved = pm.experts_moved(current_map, proposed)
    counts_before = pm.replica_counts_of(current_map, view.num_experts)
    counts_after = pm.replica_counts_of(proposed, view.num_experts)
    rate = steps_per_second(evidence)
    # The planner's cost model, fitted to this group's windows, predicts each layer's time per step
    # under either placement and the stall of moving the slots that change.
    model = fitted_cost_model(view.fit_windows or view.windows, params.cost.migration_bandwidth_bytes_per_second)
    hidden = latest.window.hidden_bytes
    t_before = cost.layer_seconds(model, load, current_map, view.num_gpus, hidden, view.num_nodes, speed)["total"]
    t_after = cost.layer_seconds(model, load, proposed, view.num_gpus, hidden, view.num_nodes, speed)["total"]
    per_node = view.num_gpus // view.num_nodes
    node_before = topology.expected_cross_node_ratio(load, current_map, view.num_gpus, per_node)
    node_after = topology.expected_cross_node_ratio(load, proposed, view.num_gpus, per_node)
    # The slowest rank's work (pairs over speed) under either placement: for a re-placement driven by
    # rank speed the gain is also read from the measured compute of the slowest rank, scaled by how its
    # work shrinks; the fitted model keeps one rate for every rank and may not see a slow device.
    work_before = rank_seconds(pm.gpu_load(load, current_map, view.num_gpus), speed).max(axis=1)
    work_after = rank_seconds(pm.gpu_load(load, proposed, view.num_gpus), speed).max(axis=1)
    rows: dict[int, tuple[np.ndarray, str]] = {}
    decisions: list[Decision] = []
    for layer in layers:
        kind = "replicate" if not np.array_equal(counts_before[layer], counts_after[layer]) else "placement"
        gain = max(0.0, float(t_before[layer] - t_after[layer])) * rate * params.horizon_seconds
        compute = measured(evidence, layer, "compute_seconds_per_step", 9)
        if view.speed_replan and compute is not None and work_before[layer] > 0:
            saved = compute * max(0.0, 1.0 - float(work_after[layer] / work_before[layer]))
            gain = max(gain, saved * rate * params.horizon_seconds)
        stall = cost.migration_stall(model, np.array([moved[layer]]), params.cost.expert_bytes)["stall_seconds"]
        if view.num_nodes > 1:  # a slot filled from another node moves its weights over the slower link
            stall = topology.migration_seconds(current_map[layer], proposed[layer], view.num_gpus,
                                               view.num_gpus // view.num_nodes, params.cost.expert_bytes,
                                               model.migration_bytes_per_second,
                                               params.cost.inter_node_bandwidth_bytes_per_second)
        if view.observed_stall_per_slot is not None:
            stall = max(stall, view.observed_stall_per_slot * int(moved[layer]))
        # An actuator that applies by a restart or the engine's own rebalance costs its whole apply, for any move.
        stall = max(stall, view.actuator.apply_seconds)
        hot = latest.diagnosis.layers[layer].metrics["hot_experts"]
        verdict = _label(*verdicts[layer]) if layer in verdicts else _speed_label(view)
        before = {"verdict": verdict, "balancedness": measured(evidence, layer, "balancedness"),
                  "model_balancedness": round(float(model_before[layer]), 4),
                  "layer_seconds_per_step": measured(evidence, layer, "layer_seconds_per_step", 9),
                  "model_layer_seconds_per_step": float(t_before[layer]),
                  "replicas": {int(e): int(counts_before[layer, e]) for e in hot},
                  "model_cross_node_ratio": round(float(node_before[layer]), 4)}
        after = {"model_balancedness": round(float(model_after[layer]), 4),
                 "model_cross_node_ratio": round(float(node_after[layer]), 4),
                 "model_layer_seconds_per_step": float(t_after[layer]),
                 "replicas": {int(e): int(counts_after[layer, e]) for e in hot},
                 "slots_moved": int(moved[layer]), "predicted_stall_seconds": stall, "num_nodes": view.num_nodes,
                 "predicted_gain_seconds": gain, "horizon_seconds": params.horizon_seconds,
                 "rank_speed": None if speed is None else [round(float(x), 4) for x in speed],
                 "plain_balancedness": round(float(pm.placement_balancedness(load, proposed, view.num_gpus)[layer]),
                                             4)}
        if moved[layer] == 0 or model_after[layer] < model_before[layer] + params.min_balancedness_gain:
            reason = (f"the planner finds no placement better by {params.min_balancedness_gain:g} "
                      f"(model balancedness {model_before[layer]:.3f} -> {model_after[layer]:.3f})")
            decisions.append(Decision(kind, (layer,), "skipped", reason, before, after))
        elif gain <= params.gain_margin * stall:
            reason = (f"does not pay: {gain:.3f} s saved over {params.horizon_seconds:g} s <= {params.gain_margin:g} x "
                      f"{stall:.3f} s stall moving {int(moved[layer])} slots")
            decisions.append(Decision(kind, (layer,), "skipped", reason, before, after))
        else:
            what = (f"hot expert{'s' if len(hot) > 1 else ''} {', '.join(map(str, hot))} "
                    if kind == "replicate" and hot else "")
            where = f" (node-aware, {view.num_nodes} nodes)" if view.num_nodes > 1 else ""
            if speed is not None:
                where += (" " if where else "") + "for rank speeds " + "/".join(f"{x:.2f}" for x in speed) + " "
            measure = "balancedness by time" if speed is not None else "balancedness"
            reason = (f"{verdict} for {k} windows: {kind} {what}{where}-> {measure} {model_before[layer]:.3f} -> "
                      f"{model_after[layer]:.3f} (model); gain {gain:.2f} s over {params.horizon_seconds:g} s vs stall "
                      f"{stall:.3f} s")
            decisions.append(Decision(kind, (layer,), "proposed", reason, before, after))
            rows[layer] = (proposed[layer], kind)
    return rows, decisions


def capacity_proposals(params: PolicyParams, evidence: Sequence[TriagedWindow], values: dict[int, tuple[float, bool]],
                       current_cap: np.ndarray) -> tuple[dict[int, float], list[Decision]]:
    """Step 6: each wanted capacity factor, bounded. Returns ({layer: value}, decisions)."""
    k = len(evidence)
    out: dict[int, float] = {}
    decisions: list[Decision] = []
    for layer, (value, lossy) in values.items():
        current = float(current_cap[layer])
        clamped = min(max(value, params.capacity_factor_min), params.capacity_factor_max)
        before = {"capacity_factor": current, "overflow_rate": mean_metric(evidence, layer, "overflow_rate")}
        after = {"capacity_factor": clamped, "suggested": value}
        if current == 0.0 and not lossy:
            decisions.append(Decision("capacity", (layer,), "skipped",
                                      "the layer is dropless: no capacity factor to raise", before, after))
        elif not lossy and clamped <= current:
            decisions.append(Decision("capacity", (layer,), "skipped",
                                      f"capacity factor already {current:g}, at the bound "
                                      f"[{params.capacity_factor_min:g}, {params.capacity_factor_max:g}] "
                                      f"(suggested {value:g})", before, after))
        else:
            out[layer] = clamped
            bounded = f" (suggested {value:g}, bounded)" if clamped != value else ""
            decisions.append(Decision("capacity", (layer,), "proposed",
                                      f"overflow {before['overflow_rate']:.1%} for {k} windows: capacity factor "
                                      f"{current:g} -> {clamped:g}{bounded}", before, after))
    return out, decisions
