"""Decisions only: what the agent would change, and whether it should. No sockets, no files, no clocks
(the caller passes `now`), so every rule is testable on simulated windows.

`decide(view, cfg, now)` runs the guardrails in order, per layer:
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
6. capacity factor within [capacity_factor_min, capacity_factor_max]; lossy caps only when allowed;
7. the global rate limit on plans per hour.
Whatever passes is folded into one whole Plan (every layer's map and capacity factor), the rest is
reported as skipped with its reason and numbers. `verify(...)` judges a plan after its Ack from the
windows of the new epoch only, and says when to roll back.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from moewatch import telemetry as tm
from moewatch import topology
from moewatch.capacity import capacity_for_windows
from moewatch.vocabulary import DECISION_KINDS
from moewatch.planner import cost
from moewatch.planner import placement_math as pm

from .store import TriagedWindow

PLACEMENT_KINDS = ("replicate", "placement")
# Engines that take no placement from outside: for their windows the agent works out what it would
# change and says so, but never proposes a plan to send (docs/integrations.md).
OBSERVE_ONLY_RUNTIMES = {"vllm": "vLLM takes no placement from outside: moewatch observes and recommends only"}
KINDS = DECISION_KINDS


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
class LayerBaseline:
    """A changed layer's state before the change, for verification."""

    layer: int
    balancedness: float  # measured, mean over the windows the decision used
    layer_seconds: float  # measured per-step layer time (slowest rank), mean
    compute_seconds: float  # measured per-step expert compute of the slowest rank, mean
    model_max_gpu_load: float  # the model's busiest-GPU pairs per step for the old map on that load
    model_bias: float  # measured minus model balancedness of the old placement on the same load
    old_map: np.ndarray  # [P] the layer's placement before
    old_capacity: float


@dataclass(frozen=True)
class Proposal:
    decisions: list[Decision]
    physical_to_logical_map: np.ndarray | None = None  # [L, P] whole desired state, when anything passed
    capacity_factor: np.ndarray | None = None  # [L]
    changed_layers: tuple[int, ...] = ()
    baseline: dict[int, LayerBaseline] = field(default_factory=dict)
    reason: str = ""

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


# --- evidence ----------------------------------------------------------------------------------------

def persistent_verdicts(windows: Sequence[TriagedWindow], k: int) -> dict[int, tuple[str, str | None]]:
    """Layers whose verdict and cause were the same, and not healthy, in each of the last k windows."""
    if len(windows) < k:
        return {}
    last = [t.diagnosis.layers for t in windows[-k:]]
    out = {}
    for layer in range(len(last[-1])):
        seen = {(layers[layer].verdict, layers[layer].cause) for layers in last}
        if len(seen) == 1:
            verdict, cause = next(iter(seen))
            if verdict != "healthy":
                out[layer] = (verdict, cause)
    return out


def persistent_overflow(windows: Sequence[TriagedWindow], k: int) -> list[int]:
    if len(windows) < k:
        return []
    last = [t.diagnosis.layers for t in windows[-k:]]
    return [layer for layer in range(len(last[-1])) if all(layers[layer].overflow for layers in last)]


def computed_load(windows: Sequence[TriagedWindow]) -> np.ndarray:
    """[L, E] pairs each expert computed per step, averaged over the windows (drops left out where
    the window counts them; a window that cannot see capacity gives its routed pairs). Windows of
    per-rank totals only (no expert_tokens) say nothing per expert and are left out."""
    counted = [t.window for t in windows if t.window.expert_tokens is not None]
    total = sum(tm.kept_tokens(w).astype(np.float64) for w in counted)
    steps = sum(max(w.steps, 1) for w in counted)
    return total / steps


def steps_per_second(windows: Sequence[TriagedWindow]) -> float:
    """Forward steps per second: from the measured step times, else (a window without per-step
    data) from the window's own span, which every source states."""
    steps, seconds = 0, 0.0
    for t in windows:
        w = t.window
        if w.step_seconds is not None:
            steps += len(w.step_seconds)
            seconds += float(w.step_seconds.sum())
        else:
            steps += w.steps
            seconds += w.end_time - w.start_time
    return steps / seconds if seconds > 0 else 0.0


def make_baseline(windows: Sequence[TriagedWindow], layer: int, old_map: np.ndarray, old_capacity: float,
                  num_gpus: int) -> LayerBaseline:
    """A layer's state before a change, from the windows the decision used. old_map: [P]."""
    load = computed_load(windows)[layer:layer + 1]
    measured = _mean_metric(windows, layer, "balancedness")
    model = float(pm.placement_balancedness(load, old_map[None, :], num_gpus)[0])
    busiest = float(pm.gpu_load(load, old_map[None, :], num_gpus).max())
    return LayerBaseline(layer, measured, _mean_metric(windows, layer, "layer_seconds_per_step"),
                         _mean_metric(windows, layer, "compute_seconds_per_step"), busiest, measured - model,
                         np.array(old_map), float(old_capacity))


def _measured(windows: Sequence[TriagedWindow], layer: int, key: str, digits: int = 4) -> float | None:
    """A measured metric's mean for a decision's numbers; None when no window measured it (absent
    evidence is reported as unknown, never as a number)."""
    value = _mean_metric(windows, layer, key)
    return round(value, digits) if math.isfinite(value) else None


def _mean_metric(windows: Sequence[TriagedWindow], layer: int, key: str) -> float:
    values = [t.diagnosis.layers[layer].metrics.get(key) for t in windows]
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else float("nan")


# --- the planner, behind two functions ------------------------------------------------------------

def capped_replica_counts(load: np.ndarray, num_slots: int, max_replicas: int) -> np.ndarray:
    """[L, E] load -> [L, E] replica counts summing to num_slots, each in [1, max_replicas] where the
    slots allow it (the planner's water-filling, then the excess handed to the experts with the most
    load per replica that are still under the cap)."""
    from moewatch.planner.replicate import replica_counts

    counts = replica_counts(load, num_slots)
    L, E = counts.shape
    cap = max(max_replicas, math.ceil(num_slots / E))  # the slots must go somewhere
    for layer in range(L):
        row = counts[layer]
        excess = int(np.maximum(row - cap, 0).sum())
        if not excess:
            continue
        row[:] = np.minimum(row, cap)
        for _ in range(excess):
            per_replica = np.where(row < cap, load[layer] / row, -np.inf)
            row[int(np.argmax(per_replica))] += 1
    return counts


def propose_placement(load: np.ndarray, current: np.ndarray, num_gpus: int, num_nodes: int,
                      max_replicas: int) -> np.ndarray:
    """[L, E] load, [L, P] current placement -> [L, P] proposed placement (every layer).

    The planner's movement-aware solve (as few slots changed as a near-balanced plan allows); a layer
    where it gives an expert more than `max_replicas` slots is re-packed from capped replica counts
    and aligned to the current placement, with the planner's packing and alignment."""
    from moewatch.planner.movement import align_to_current
    from moewatch.planner.packing import pack
    from moewatch.planner.solve import solve_placement

    E = load.shape[1]
    proposed = np.array(solve_placement(load, num_gpus, current.shape[1], num_nodes,
                                        current=current).physical_to_logical_map)
    over = np.flatnonzero(pm.replica_counts_of(proposed, E).max(axis=1) > max_replicas)
    if over.size:
        counts = capped_replica_counts(load[over], current.shape[1], max_replicas)
        repacked = align_to_current(pack(load[over], counts, num_gpus, num_nodes), current[over], num_gpus, num_nodes)
        proposed[over] = repacked
    return proposed


def fitted_cost_model(windows: Sequence[TriagedWindow], migration_bandwidth: float):
    """The planner's cost model fitted to the group's windows (parameters the windows cannot pin down
    keep the model's defaults); the defaults when the fit fails."""
    base = cost.CostModel(migration_bytes_per_second=migration_bandwidth)
    try:
        model, _ = cost.fit([t.window for t in windows], base)
    except (ValueError, np.linalg.LinAlgError):
        return base
    return model


# --- decide -------------------------------------------------------------------------------------------

def decide(view: GroupView, cfg, now: float) -> Proposal:
    """The guardrails above, for one group; `cfg` is an AgentConfig (mode, K, cooldown, bounds...)."""
    note = OBSERVE_ONLY_RUNTIMES.get(view.windows[-1].window.runtime) if view.windows else None
    if note is not None and cfg.mode != "observe":
        return _recommend_only(view, cfg, now, note)
    return _decide(view, cfg, now)


def _decide(view: GroupView, cfg, now: float) -> Proposal:
    windows = list(view.windows)
    k = cfg.persist_windows
    if cfg.mode == "observe" or len(windows) < k:
        return Proposal([])
    evidence = windows[-k:]
    latest = evidence[-1].window
    current_map = np.array(latest.physical_to_logical_map)
    current_cap = np.array(latest.capacity_factor, dtype=np.float64)
    decisions, placement_layers, capacity_values = choose_levers(view, cfg, evidence, now)
    placed, placement_decisions = placement_proposals(view, cfg, evidence, placement_layers, current_map)
    capped, capacity_decisions = capacity_proposals(cfg, evidence, capacity_values, current_cap)
    pending = placement_decisions + capacity_decisions
    decisions += [d for d in pending if d.result == "skipped"]
    pending = [d for d in pending if d.result == "proposed"]
    if not pending:
        return Proposal(decisions)
    recent = [t for t in view.plan_times if now - t < 3600.0]
    if cfg.mode == "act" and len(recent) >= cfg.max_plans_per_hour:
        decisions += [Decision(d.kind, d.layers, "skipped", f"rate limit: {len(recent)} plans in the last hour "
                               f"(max {cfg.max_plans_per_hour}); would have: {d.reason}", d.before, d.after)
                      for d in pending]
        return Proposal(decisions)
    if cfg.mode == "act" and "rank_load" in latest.missing_evidence:
        # Verification and rollback judge a change by measured rank load: without it a live change
        # could not be checked, so it stays a recommendation.
        decisions += [Decision(d.kind, d.layers, "recommended", d.reason + "; not applied: the windows carry no "
                               "rank-level counts, so the change could not be verified", d.before, d.after)
                      for d in pending]
        return Proposal(decisions)
    result = "recommended" if cfg.mode == "recommend" else "proposed"
    decisions += [Decision(d.kind, d.layers, result, d.reason, d.before, d.after) for d in pending]
    new_map, new_cap = current_map.copy(), current_cap.copy()
    kinds: dict[int, str] = {}
    for layer, (row, kind) in placed.items():
        new_map[layer] = row
        kinds[layer] = kind
    for layer, value in capped.items():
        new_cap[layer] = value
        kinds.setdefault(layer, "capacity")
    baseline = {layer: make_baseline(evidence, layer, current_map[layer], float(current_cap[layer]), view.num_gpus)
                for layer in kinds}
    summary = "; ".join(f"layer {layer}: {kind}" for layer, kind in sorted(kinds.items()))
    return Proposal(decisions, new_map, new_cap, tuple(sorted(kinds)), baseline, summary)


def _recommend_only(view: GroupView, cfg, now: float, note: str) -> Proposal:
    """The decisions for an engine that applies no plan: the planner still says what it would change
    (as if placement were a lever), every such decision is a recommendation naming why, and no plan
    leaves the agent, whatever the mode."""
    view = dataclasses.replace(view, capabilities=view.capabilities | {"plan"})
    proposal = _decide(view, dataclasses.replace(cfg, mode="recommend"), now)
    return Proposal([Decision(d.kind, d.layers, d.result, f"{d.reason} ({note})", d.before, d.after)
                     for d in proposal.decisions])


def _label(verdict: str, cause: str | None) -> str:
    return verdict + (f"/{cause}" if cause else "")


def choose_levers(view: GroupView, cfg, evidence: Sequence[TriagedWindow], now: float
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
        numbers = {"balancedness": _measured(evidence, layer, "balancedness"),
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
        if since is not None and now - since < cfg.cooldown_seconds:
            skip(next((a.kind for a in diag.actions), "placement"), layer,
                 f"{label}: layer in cooldown for another {cfg.cooldown_seconds - (now - since):.0f} s")
            continue
        if layer in verdicts and "expert_load" in diag.missing:
            # Per-rank totals show the imbalance; which experts to replicate or move needs their load.
            skip("placement", layer, f"{label} for {k} windows, but no plan: the windows carry per-rank totals "
                 "without per-expert counts (expert_tokens), so no replica or placement can be computed; "
                 "add a source with per-expert counts (SGLang's expert-distribution dumps or its hook)")
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
                    "batch", (layer,), "recommended" if cfg.mode == "recommend" else "skipped",
                    f"{label}: {action.summary}" + ("" if cfg.mode == "recommend"
                                                    else " The batch is the operator's to change."),
                    {"a2a_share": diag.metrics["a2a_share"], "mean_message_bytes": diag.metrics["mean_message_bytes"]},
                    {"predicted_gain": round(action.predicted_gain, 4)}))
            elif lossy_cap is not None and layer not in overflowing:
                if not cfg.allow_lossy_capacity:
                    skip("capacity", layer, f"{label}: the only action is a lossy cap at capacity factor "
                         f"{lossy_cap.params['value']:g} (drops pairs); set allow_lossy_capacity to allow it")
                elif "capacity" in view.capabilities:
                    capacity[layer] = (float(lossy_cap.params["value"]), True)
                else:
                    skip("capacity", layer, f"{label}: the runtime does not take a capacity factor")
            else:
                skip("placement", layer, f"{label} for {k} windows but the triage names no action to take")
        if layer in overflowing and first["capacity"] is not None:
            if "capacity" in view.capabilities:
                # The per-step solve over the evidence windows: one window's average understates C.
                wanted = capacity_for_windows([e.window for e in evidence], layer, cfg.thresholds.overflow_target)
                capacity[layer] = (min(wanted, cfg.thresholds.max_capacity_factor), False)
            else:
                skip("capacity", layer, f"{label}: the runtime does not take a capacity factor")
    return decisions, placement, capacity


def placement_proposals(view: GroupView, cfg, evidence: Sequence[TriagedWindow], layers: dict[int, str],
                        current_map: np.ndarray) -> tuple[dict[int, tuple[np.ndarray, str]], list[Decision]]:
    """Steps 4-5 for the layers that want a placement change: the planner's proposal, through the
    cost gate. Returns ({layer: (new [P] row, kind)}, proposed and skipped decisions)."""
    if not layers:
        return {}, []
    k = len(evidence)
    latest = evidence[-1]
    verdicts = persistent_verdicts(evidence, k)
    load = computed_load(evidence)
    proposed = propose_placement(load, current_map, view.num_gpus, view.num_nodes, cfg.max_replicas_per_expert)
    model_before = pm.placement_balancedness(load, current_map, view.num_gpus)
    model_after = pm.placement_balancedness(load, proposed, view.num_gpus)
    moved = pm.experts_moved(current_map, proposed)
    counts_before = pm.replica_counts_of(current_map, view.num_experts)
    counts_after = pm.replica_counts_of(proposed, view.num_experts)
    rate = steps_per_second(evidence)
    # The planner's cost model, fitted to this group's windows, predicts each layer's time per step
    # under either placement and the stall of moving the slots that change.
    model = fitted_cost_model(view.fit_windows or view.windows, cfg.migration_bandwidth_bytes_per_second)
    hidden = latest.window.hidden_bytes
    t_before = cost.layer_seconds(model, load, current_map, view.num_gpus, hidden, view.num_nodes)["total"]
    t_after = cost.layer_seconds(model, load, proposed, view.num_gpus, hidden, view.num_nodes)["total"]
    per_node = view.num_gpus // view.num_nodes
    node_before = topology.expected_cross_node_ratio(load, current_map, view.num_gpus, per_node)
    node_after = topology.expected_cross_node_ratio(load, proposed, view.num_gpus, per_node)
    rows: dict[int, tuple[np.ndarray, str]] = {}
    decisions: list[Decision] = []
    for layer in layers:
        kind = "replicate" if not np.array_equal(counts_before[layer], counts_after[layer]) else "placement"
        gain = max(0.0, float(t_before[layer] - t_after[layer])) * rate * cfg.horizon_seconds
        stall = cost.migration_stall(model, np.array([moved[layer]]), cfg.expert_bytes)["stall_seconds"]
        if view.num_nodes > 1:  # a slot filled from another node moves its weights over the slower link
            stall = topology.migration_seconds(current_map[layer], proposed[layer], view.num_gpus,
                                               view.num_gpus // view.num_nodes, cfg.expert_bytes,
                                               model.migration_bytes_per_second,
                                               cfg.inter_node_bandwidth_bytes_per_second)
        if view.observed_stall_per_slot is not None:
            stall = max(stall, view.observed_stall_per_slot * int(moved[layer]))
        if getattr(cfg, "actuator", "runtime") == "sglang":
            # SGLang takes a placement only by a restart or its own rebalance: the whole cost, for any move.
            stall = max(stall, cfg.sglang_apply_seconds)
        hot = latest.diagnosis.layers[layer].metrics["hot_experts"]
        verdict = _label(*verdicts[layer])
        before = {"verdict": verdict, "balancedness": _measured(evidence, layer, "balancedness"),
                  "model_balancedness": round(float(model_before[layer]), 4),
                  "layer_seconds_per_step": _measured(evidence, layer, "layer_seconds_per_step", 9),
                  "model_layer_seconds_per_step": float(t_before[layer]),
                  "replicas": {int(e): int(counts_before[layer, e]) for e in hot},
                  "model_cross_node_ratio": round(float(node_before[layer]), 4)}
        after = {"model_balancedness": round(float(model_after[layer]), 4),
                 "model_cross_node_ratio": round(float(node_after[layer]), 4),
                 "model_layer_seconds_per_step": float(t_after[layer]),
                 "replicas": {int(e): int(counts_after[layer, e]) for e in hot},
                 "slots_moved": int(moved[layer]), "predicted_stall_seconds": stall, "num_nodes": view.num_nodes,
                 "predicted_gain_seconds": gain, "horizon_seconds": cfg.horizon_seconds}
        if moved[layer] == 0 or model_after[layer] < model_before[layer] + cfg.min_balancedness_gain:
            reason = (f"the planner finds no placement better by {cfg.min_balancedness_gain:g} "
                      f"(model balancedness {model_before[layer]:.3f} -> {model_after[layer]:.3f})")
            decisions.append(Decision(kind, (layer,), "skipped", reason, before, after))
        elif gain <= cfg.gain_margin * stall:
            reason = (f"does not pay: {gain:.3f} s saved over {cfg.horizon_seconds:g} s <= {cfg.gain_margin:g} x "
                      f"{stall:.3f} s stall moving {int(moved[layer])} slots")
            decisions.append(Decision(kind, (layer,), "skipped", reason, before, after))
        else:
            what = (f"hot expert{'s' if len(hot) > 1 else ''} {', '.join(map(str, hot))} "
                    if kind == "replicate" and hot else "")
            where = f" (node-aware, {view.num_nodes} nodes)" if view.num_nodes > 1 else ""
            reason = (f"{verdict} for {k} windows: {kind} {what}{where}-> balancedness {model_before[layer]:.3f} -> "
                      f"{model_after[layer]:.3f} (model); gain {gain:.2f} s over {cfg.horizon_seconds:g} s vs stall "
                      f"{stall:.3f} s")
            decisions.append(Decision(kind, (layer,), "proposed", reason, before, after))
            rows[layer] = (proposed[layer], kind)
    return rows, decisions


def capacity_proposals(cfg, evidence: Sequence[TriagedWindow], values: dict[int, tuple[float, bool]],
                       current_cap: np.ndarray) -> tuple[dict[int, float], list[Decision]]:
    """Step 6: each wanted capacity factor, bounded. Returns ({layer: value}, decisions)."""
    k = len(evidence)
    out: dict[int, float] = {}
    decisions: list[Decision] = []
    for layer, (value, lossy) in values.items():
        current = float(current_cap[layer])
        clamped = min(max(value, cfg.capacity_factor_min), cfg.capacity_factor_max)
        before = {"capacity_factor": current, "overflow_rate": _mean_metric(evidence, layer, "overflow_rate")}
        after = {"capacity_factor": clamped, "suggested": value}
        if current == 0.0 and not lossy:
            decisions.append(Decision("capacity", (layer,), "skipped",
                                      "the layer is dropless: no capacity factor to raise", before, after))
        elif not lossy and clamped <= current:
            decisions.append(Decision("capacity", (layer,), "skipped",
                                      f"capacity factor already {current:g}, at the bound [{cfg.capacity_factor_min:g}, "
                                      f"{cfg.capacity_factor_max:g}] (suggested {value:g})", before, after))
        else:
            out[layer] = clamped
            bounded = f" (suggested {value:g}, bounded)" if clamped != value else ""
            decisions.append(Decision("capacity", (layer,), "proposed",
                                      f"overflow {before['overflow_rate']:.1%} for {k} windows: capacity factor "
                                      f"{current:g} -> {clamped:g}{bounded}", before, after))
    return out, decisions


# --- verify -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verification:
    status: str  # wait | keep | rollback
    worse_layers: tuple[int, ...] = ()
    reason: str = ""
    numbers: dict[int, dict[str, float]] = field(default_factory=dict)


# Verification decides on at least this many windows of the new epoch (verify_windows may ask more),
# and waits up to VERIFY_PATIENCE times as many for a regression seen in the median to persist.
MIN_VERIFY_WINDOWS = 3
VERIFY_PATIENCE = 3


def _layer_evidence(base: LayerBaseline, window: TriagedWindow, num_gpus: int) -> dict[str, float]:
    """One window of the new epoch against the control for the same traffic: the old map on this
    window's load (its balancedness, corrected by the model's bias measured before the change, and
    its time per step). The time control is the time before, its slowest-rank compute scaled by how
    the old map's busiest GPU grows or shrinks with this load, and by how fast the machine computes a
    pair now against before (so a machine-wide slowdown, e.g. other work on shared cores, is not
    blamed on the plan, while a plan that makes the layer slow in another way still is)."""
    layer = base.layer
    metrics = window.diagnosis.layers[layer].metrics
    load = computed_load([window])[layer:layer + 1]
    old_row = base.old_map[None, :]
    old_model = float(pm.placement_balancedness(load, old_row, num_gpus)[0])
    growth = (float(pm.gpu_load(load, old_row, num_gpus).max()) / base.model_max_gpu_load
              if base.model_max_gpu_load > 0 else 1.0)
    speed = 1.0
    compute = metrics.get("compute_seconds_per_step")
    new_busiest = float(pm.gpu_load(load, np.asarray(window.window.physical_to_logical_map)[layer:layer + 1],
                                    num_gpus).max())
    if (compute is not None and math.isfinite(compute) and new_busiest > 0 and base.model_max_gpu_load > 0
            and base.compute_seconds > 0 and math.isfinite(base.compute_seconds)):
        per_pair_now = compute / new_busiest
        per_pair_before = base.compute_seconds / base.model_max_gpu_load
        speed = min(2.0, max(0.5, per_pair_now / per_pair_before))
    seconds = metrics.get("layer_seconds_per_step")
    balancedness = metrics.get("balancedness")  # absent evidence: NaN, which never reads as a regression
    return {"balancedness": float("nan") if balancedness is None else float(balancedness),
            "balancedness_control": min(1.0, old_model + base.model_bias),
            "seconds": float("nan") if seconds is None else float(seconds),
            "seconds_control": (base.layer_seconds + base.compute_seconds * (growth - 1.0)) * speed,
            "machine_speed": speed}


def verify(baseline: dict[int, LayerBaseline], windows: Sequence[TriagedWindow], cfg, num_gpus: int) -> Verification:
    """Judge a plan from `windows` (only those of its epoch: the caller fences).

    Each window of the new epoch is compared, per changed layer, with the control for the same
    traffic (`_layer_evidence`: the old map on that window's load). A layer regressed when
    - its balancedness is below the control's by more than rollback_balancedness_drop, or
    - its time per step is above the control's by more than rollback_time_rise.
    Noise cannot decide alone: the verdict uses the median over the last n windows
    (n = max(verify_windows, MIN_VERIFY_WINDOWS)), and a rollback also needs the regression in every
    one of those n windows (it persists). A median regression that does not persist waits for more
    windows, up to VERIFY_PATIENCE * n of them, then the plan is kept. Comparing with the old map on
    the same traffic keeps a shift in traffic after the change (drift) from being blamed on it.
    """
    n = max(cfg.verify_windows, MIN_VERIFY_WINDOWS)
    if len(windows) < n:
        return Verification("wait")
    recent = list(windows[-n:])
    worse, numbers, reasons, unsettled = [], {}, [], []
    for layer, base in baseline.items():
        seen = [_layer_evidence(base, t, num_gpus) for t in recent]
        drop = np.array([e["balancedness"] - e["balancedness_control"] for e in seen])
        rise = np.array([e["seconds"] / e["seconds_control"] - 1.0
                         if math.isfinite(e["seconds"]) and e["seconds_control"] > 0 else float("nan") for e in seen])
        med = {k: float(np.median([e[k] for e in seen])) for k in seen[0]}
        numbers[layer] = {"balancedness_before": base.balancedness, "balancedness_after": med["balancedness"],
                          "balancedness_old_map_same_load": med["balancedness_control"],
                          "layer_seconds_before": base.layer_seconds, "layer_seconds_after": med["seconds"],
                          "layer_seconds_old_map_same_load": med["seconds_control"],
                          "machine_speed": med["machine_speed"], "windows": n}
        balance_median = float(np.median(drop)) < -cfg.rollback_balancedness_drop
        balance_persists = bool(np.all(drop < -cfg.rollback_balancedness_drop))
        timed = rise[np.isfinite(rise)]
        time_median = len(timed) == n and float(np.median(timed)) > cfg.rollback_time_rise
        time_persists = len(timed) == n and bool(np.all(timed > cfg.rollback_time_rise))
        if balance_median and balance_persists:
            worse.append(layer)
            reasons.append(f"layer {layer} balancedness {med['balancedness']:.3f} vs {med['balancedness_control']:.3f} "
                           f"with the old placement on the same load (median of {n} windows, each worse)")
        elif time_median and time_persists:
            worse.append(layer)
            reasons.append(f"layer {layer} takes {med['seconds'] * 1e3:.2f} ms/step vs {med['seconds_control'] * 1e3:.2f} "
                           f"expected with the old placement on the same load (+{float(np.median(timed)):.0%}, "
                           f"median of {n} windows, each slower)")
        elif balance_median or time_median:
            unsettled.append(layer)
    if worse:
        return Verification("rollback", tuple(worse), "; ".join(reasons), numbers)
    if unsettled and len(windows) < VERIFY_PATIENCE * n:
        return Verification("wait", (), f"layers {unsettled}: a regression in the median that did not persist in "
                            f"every window; waiting for more windows", numbers)
    if unsettled:
        return Verification("keep", (), f"layers {unsettled} regressed in some windows, never in {n} in a row over "
                            f"{len(windows)} windows: kept", numbers)
    return Verification("keep", (), "every changed layer held or improved", numbers)
