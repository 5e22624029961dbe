"""The documented triage order (seed 000, "observable signals and fault location"), per layer.

1. All-to-all share of layer time: at or above `comm_share`, communication dominates.
2. Dispersion of per-rank load (std/mean, max/mean): large means load imbalance. A fast rank's
   all-to-all time includes its wait for the straggler, so a high share *with* large dispersion is
   imbalance, not volume: this step is what tells the two apart.
3. Cross-rank ratio against what the placement predicts: well above it means the expert-to-rank
   mapping drives the traffic; at the prediction, the traffic is the inherent volume.

Verdicts and causes:
- imbalance-bound / hot-experts: ranks imbalanced and a few experts carry the load.
- imbalance-bound / straggler: ranks imbalanced without hot experts (the packing puts too much on
  one rank), or, at even load, one rank's expert compute is much slower (a slow device).
- comm-bound / small-batch: balanced, comm-dominated, messages under the seed's 32 KB.
- comm-bound / placement: balanced, comm-dominated, cross-rank ratio above the prediction.
- comm-bound / volume: balanced, comm-dominated, traffic as the placement predicts.
- healthy otherwise. `overflow` is a flag on top of any verdict.

Every predicted gain is the share of the layer's per-step time an action is expected to remove,
estimated from this window alone (the planner's cost model refines it). Pure functions of a Window.

Absent evidence (a source that cannot measure timings or rank-level counts): a step whose evidence
is missing is reported as unknown, in the evidence and as null metrics; the verdict comes from the
steps that have evidence, and each layer lists what was missing (`missing`, EVIDENCE kinds). With
no rank-level counts, step 2 falls back on the one dispersion every window has, the expert load's.
An action whose gain needs an unmeasured number carries `predicted_gain` None, never an estimate.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import telemetry as tm
from .telemetry import Window
from .thresholds import Thresholds

HEALTHY, COMM_BOUND, IMBALANCE_BOUND = "healthy", "comm-bound", "imbalance-bound"
VERDICTS = (HEALTHY, COMM_BOUND, IMBALANCE_BOUND)
CAUSES = ("volume", "placement", "small-batch", "hot-experts", "straggler")
ACTION_KINDS = ("replicate", "capacity", "placement", "batch")


@dataclass(frozen=True)
class Action:
    kind: str  # one of ACTION_KINDS
    predicted_gain: float | None  # share of the layer's per-step time removed, in [0, 1); None: unknown
    summary: str  # one sentence for an operator
    params: dict[str, Any] = field(default_factory=dict)  # experts, value, ...

    def to_dict(self) -> dict[str, Any]:
        gain = None if self.predicted_gain is None else round(self.predicted_gain, 4)
        return {"kind": self.kind, "predicted_gain": gain, "summary": self.summary, **self.params}


@dataclass(frozen=True)
class LayerDiagnosis:
    layer: int
    verdict: str
    cause: str | None
    overflow: bool
    metrics: dict[str, Any]
    evidence: list[str]
    actions: list[Action]
    # Seconds per step this layer could save with its best action: the ranking key (NaN: unknown).
    seconds_at_stake: float
    # Evidence kinds (telemetry.EVIDENCE) the window lacked: their triage steps are unknown.
    missing: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "verdict": self.verdict, "cause": self.cause, "overflow": self.overflow,
                "seconds_at_stake": _finite(self.seconds_at_stake), "missing": self.missing,
                "metrics": self.metrics, "evidence": self.evidence, "actions": [a.to_dict() for a in self.actions]}


@dataclass(frozen=True)
class WindowDiagnosis:
    identity: dict[str, Any]
    layers: list[LayerDiagnosis]  # in layer order
    summary: dict[str, Any]

    def worst_first(self) -> list[LayerDiagnosis]:
        return sorted(self.layers, key=_severity_key)

    def to_dict(self) -> dict[str, Any]:
        return {**self.identity, "summary": self.summary, "layers": [d.to_dict() for d in self.layers]}


def _severity_key(d: LayerDiagnosis) -> tuple:
    stake = d.seconds_at_stake if math.isfinite(d.seconds_at_stake) else 0.0
    return (d.verdict == HEALTHY, not d.overflow, -stake, d.layer)


def _finite(x: Any) -> Any:
    """JSON-safe number: non-finite becomes None."""
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


# --- load-shape estimates behind the predicted gains ------------------------------------------

def pack_max_load(item_loads: np.ndarray, num_ranks: int, slots_per_rank: int) -> float:
    """Busiest rank's load after greedy packing (heaviest item to the least-loaded rank with a free
    slot). item_loads: [n] with n <= num_ranks * slots_per_rank. An estimate, not the planner."""
    loads = np.zeros(num_ranks)
    free = np.full(num_ranks, slots_per_rank)
    for item in np.sort(np.asarray(item_loads, dtype=np.float64))[::-1]:
        open_ranks = np.flatnonzero(free > 0)
        target = open_ranks[np.argmin(loads[open_ranks])]
        loads[target] += item
        free[target] -= 1
    return float(loads.max())


def replica_split(expert_load: np.ndarray, experts: list[int], extra_slots: int) -> np.ndarray:
    """Slot loads after giving `extra_slots` replicas to `experts`, one at a time to whichever of
    them has the most load per replica. expert_load: [E] -> [E + extra_slots]."""
    expert_load = np.asarray(expert_load, dtype=np.float64)
    replicas = {e: 1 for e in experts}
    for _ in range(extra_slots):
        e = max(experts, key=lambda x: expert_load[x] / replicas[x])
        replicas[e] += 1
    parts = [np.full(replicas.get(e, 1), expert_load[e] / replicas.get(e, 1)) for e in range(len(expert_load))]
    return np.concatenate(parts)


def capacity_for_overflow(expert_load: np.ndarray, target: float) -> float:
    """Smallest capacity factor C (capacity = C x mean expert load) whose overflow share of the
    routed pairs stays at or under `target`, assuming the window's per-expert shares hold per step.
    expert_load: [E]. Returns 0.0 for an idle layer."""
    load = np.sort(np.asarray(expert_load, dtype=np.float64))[::-1]
    total, mean = load.sum(), load.mean()
    if total <= 0:
        return 0.0
    budget = target * total
    # overflow(C) = sum(max(0, load - C*mean)) is piecewise linear and decreasing in C: walk the
    # breakpoints (the loads themselves) until the budget is met, then interpolate within the piece.
    for n_over in range(1, len(load) + 1):
        next_level = load[n_over] if n_over < len(load) else 0.0
        overflow_at_next = float((load[:n_over] - next_level).sum())
        if overflow_at_next > budget or n_over == len(load):
            cap = (load[:n_over].sum() - budget) / n_over
            return float(max(cap, 0.0) / mean)
    return float(load[0] / mean)  # pragma: no cover - loop always returns


def overflow_at_capacity(expert_load: np.ndarray, capacity_factor: float) -> float:
    """Share of routed pairs over capacity when capacity = C x mean expert load. expert_load: [E]."""
    load = np.asarray(expert_load, dtype=np.float64)
    total = load.sum()
    if total <= 0 or capacity_factor <= 0:
        return 0.0
    return float(np.maximum(load - capacity_factor * load.mean(), 0.0).sum() / total)


# --- the triage --------------------------------------------------------------------------------

# Why each evidence kind is missing, in words: the fields a source would have to carry.
_NEEDS = {kind: " or ".join(" + ".join(opt) for opt in options) for kind, options in tm.EVIDENCE.items()}


def unknown_text(what: str, kind: str) -> str:
    """One evidence line for a triage step the window cannot support."""
    return f"{what}: unknown (the window does not carry {_NEEDS[kind]})."


def _column(values: np.ndarray | None, layer: int) -> Any:
    return None if values is None else _finite(float(values[layer]))


def layer_metrics(w: Window, t: Thresholds) -> list[dict[str, Any]]:
    """The numbers behind each layer's verdict, JSON-ready (per-step values divide by w.steps).
    A number the window cannot support is None (null in JSON), never an estimate."""
    steps = max(w.steps, 1)
    load = tm.rank_load(w)
    bound = tm.a2a_lower_bound_seconds(w, t.link_bandwidth_bytes_per_second)
    measured = tm.a2a_measured_seconds(w)
    cols = {
        "a2a_share": tm.a2a_share(w),
        "rank_load_max_min": tm.rank_load_max_min(w),
        "rank_load_max_mean": tm.rank_load_max_mean(w),
        "rank_load_cv": tm.rank_load_cv(w),
        "balancedness": tm.balancedness(w),
        "expert_load_cv": tm.expert_load_cv(w),
        "cross_rank_ratio": tm.cross_rank_ratio(w),
        "expected_cross_rank_ratio": tm.expected_cross_rank_ratio(w),
        "overflow_rate": tm.overflow_rate(w),
        "effective_capacity_factor": tm.effective_capacity_factor(w),
        "a2a_efficiency": tm.a2a_efficiency(w, t.link_bandwidth_bytes_per_second),
        "a2a_lower_bound_seconds_per_step": None if bound is None else bound / steps,
        "a2a_seconds_per_step": None if measured is None else measured / steps,
        "dispatch_seconds_per_step": tm.per_step_max(w, "dispatch_seconds"),
        "combine_seconds_per_step": tm.per_step_max(w, "combine_seconds"),
        "compute_seconds_per_step": tm.per_step_max(w, "compute_seconds"),
        "layer_seconds_per_step": tm.per_step_max(w, "layer_seconds"),
        "compute_max_mean": tm.compute_max_mean(w),
        "mean_message_bytes": tm.mean_message_bytes(w),
        "capacity_factor": w.capacity_factor,
    }
    hot = tm.hot_experts(w, t.hot_expert_multiple)
    routed = w.expert_tokens.sum(axis=1)
    dropped = None if w.dropped_tokens is None else w.dropped_tokens.sum(axis=1)
    rerouted = None if w.rerouted_tokens is None else w.rerouted_tokens.sum(axis=1)
    out = []
    for layer in range(w.num_layers):
        row = {name: _column(col, layer) for name, col in cols.items()}
        row.update({
            "routed_pairs": int(routed[layer]),
            "dropped_pairs": None if dropped is None else int(dropped[layer]),
            "rerouted_pairs": None if rerouted is None else int(rerouted[layer]),
            "rank_load": None if load is None else [int(x) for x in load[layer]],
            "busiest_rank": None if load is None else int(np.argmax(load[layer])),
            "hot_experts": hot[layer],
        })
        out.append(row)
    return out


def diagnose_layer(w: Window, layer: int, m: dict[str, Any], t: Thresholds,
                   missing: list[str] | None = None) -> LayerDiagnosis:
    """Apply the documented order to one layer's metrics `m` (from layer_metrics). `missing`: the
    window's missing evidence kinds (computed once per window by `diagnose`)."""
    missing = list(w.missing_evidence if missing is None else missing)
    evidence: list[str] = []
    overflow = m["overflow_rate"] is not None and m["overflow_rate"] > t.overflow_rate
    layer_step = m["layer_seconds_per_step"]

    if m["routed_pairs"] < t.min_routed_pairs or (layer_step is not None and layer_step <= 0):
        evidence.append("The layer routed no pairs in this window: nothing to judge.")
        return LayerDiagnosis(layer, HEALTHY, None, False, m, evidence, [], 0.0, missing)

    # 1. Is communication dominant?
    share = m["a2a_share"]
    comm: bool | None = None
    if share is None:
        evidence.append(unknown_text("All-to-all share of layer time", "a2a_time"))
    else:
        comm = share >= t.comm_share
        evidence.append(
            f"All-to-all takes {share:.0%} of layer time (threshold {t.comm_share:.0%}): "
            + ("communication dominates." if comm else "communication does not dominate."))

    # 2. Are the ranks balanced?
    busiest, cv, max_mean = m["busiest_rank"], m["rank_load_cv"], m["rank_load_max_mean"]
    imbalanced: bool | None = None
    if cv is None:
        evidence.append(unknown_text("Rank load", "rank_load"))
    else:
        imbalanced = cv > t.rank_load_cv or max_mean > t.rank_load_max_mean
        max_min = m["rank_load_max_min"]
        max_min_text = "inf" if max_min is None else f"{max_min:.2f}"
        if imbalanced:
            evidence.append(
                f"Rank {busiest} computes {max_mean:.2f}x the mean load (max/min {max_min_text}, "
                f"std/mean {cv:.2f}; threshold {t.rank_load_cv:.2f}): the other ranks wait for it"
                + (" inside the all-to-all." if comm else "."))
        else:
            evidence.append(f"Ranks are balanced: std/mean {cv:.2f}, max/mean {max_mean:.2f}.")
    hot = m["hot_experts"]
    skewed = bool(hot) and m["expert_load_cv"] > t.expert_load_cv
    if hot:
        mean_expert = m["routed_pairs"] / w.num_experts
        shown = ", ".join(f"{e} ({w.expert_tokens[layer, e] / mean_expert:.1f}x)" for e in hot[:5])
        evidence.append(f"Hot experts (over {t.hot_expert_multiple:g}x the mean load): {shown}; "
                        f"expert load std/mean {m['expert_load_cv']:.2f}.")
    if imbalanced is None and skewed:
        evidence.append("Without rank load, the expert load's own dispersion is step 2's evidence: "
                        "the layer is judged imbalanced on skewed expert load.")

    # 3. Does the mapping drive the traffic?
    cross, expected = m["cross_rank_ratio"], m["expected_cross_rank_ratio"]
    mapping_driven: bool | None = None
    if cross is None:
        evidence.append(unknown_text(f"Cross-rank ratio (the placement predicts {expected:.0%})", "cross_rank"))
    else:
        mapping_driven = cross > expected + t.cross_rank_margin
        evidence.append(
            f"{cross:.0%} of pairs cross ranks; the placement predicts {expected:.0%}"
            + (": the expert-to-rank mapping drives the traffic." if mapping_driven else "."))
    small = None if m["mean_message_bytes"] is None else m["mean_message_bytes"] < t.small_message_bytes

    if imbalanced or (imbalanced is None and skewed):
        verdict, cause = IMBALANCE_BOUND, ("hot-experts" if skewed else "straggler")
    elif comm:
        verdict = COMM_BOUND
        if small:
            cause = "small-batch"
            evidence.append(f"Messages average {m['mean_message_bytes']:.0f} B, under "
                            f"{t.small_message_bytes:.0f} B: fixed per-message cost dominates.")
        elif small is None or mapping_driven is None:
            cause = None
            evidence.append("Cause unknown: message size and cross-rank traffic were not measured.")
        else:
            cause = "placement" if mapping_driven else "volume"
    elif (imbalanced is False and m["compute_max_mean"] is not None
          and m["compute_max_mean"] > t.compute_straggler_max_mean):
        verdict, cause = IMBALANCE_BOUND, "straggler"
        slow = int(np.argmax(w.compute_seconds[layer]))
        evidence.append(f"At even load, rank {slow}'s expert compute takes {m['compute_max_mean']:.2f}x the "
                        "mean: a slow device.")
    else:
        verdict, cause = HEALTHY, None
    if overflow:
        evidence.append(f"Overflow: {m['overflow_rate']:.1%} of routed pairs were dropped or rerouted "
                        f"(threshold {t.overflow_rate:.0%}).")
    elif m["overflow_rate"] is None:
        evidence.append(unknown_text("Overflow", "capacity"))
    if missing:
        evidence.append(f"Verdict from the steps with evidence; missing: {', '.join(missing)}.")

    actions = _rank_actions(w, layer, m, t, verdict, cause, overflow)
    best = actions[0].predicted_gain if actions else 0.0
    if best == 0.0:
        stake = 0.0
    else:
        stake = math.nan if best is None or layer_step is None else best * layer_step
    return LayerDiagnosis(layer, verdict, cause, overflow, m, evidence, actions, stake, missing)


def _round_up(capacity_factor: float) -> float:
    """Two decimals for humans, rounded up so the overflow target still holds."""
    return math.ceil(capacity_factor * 100 - 1e-9) / 100


def _rank_actions(w: Window, layer: int, m: dict[str, Any], t: Thresholds,
                  verdict: str, cause: str | None, overflow: bool) -> list[Action]:
    W, spr = w.world_size, w.slots_per_rank
    expert_load = tm.kept_tokens(w)[layer].astype(np.float64)
    # Gains are relative to the busiest rank's measured load: unknown (None) without rank load.
    now_max = None if m["rank_load"] is None else float(max(np.max(m["rank_load"]), 1))
    share = m["a2a_share"]
    actions: list[Action] = []

    def relief(after: float) -> float | None:
        return None if now_max is None else max(0.0, 1.0 - after / now_max)

    if verdict == IMBALANCE_BOUND or cause == "volume":
        hot = m["hot_experts"] or [int(e) for e in np.argsort(-expert_load, kind="stable")[:max(1, W // 2)]]
        extra = max(len(hot), W // 2)
        split = replica_split(expert_load, hot, extra)
        gain = relief(pack_max_load(split, W, spr + math.ceil(extra / W)))
        if cause == "volume":
            # Replicas also keep pairs local: the cross-rank share falls by the replicas' local hits.
            gain = max(gain or 0.0, share * min(1.0, extra / max(w.num_slots, 1)))
        actions.append(Action("replicate", gain,
                              f"Replicate expert{'s' if len(hot) > 1 else ''} {', '.join(map(str, hot))} "
                              f"with {extra} extra slot{'s' if extra > 1 else ''}.",
                              {"experts": hot, "extra_slots": extra}))

    if verdict == IMBALANCE_BOUND or cause == "placement":
        gain = None if w.slot_tokens is None else relief(pack_max_load(w.slot_tokens[layer].astype(np.float64), W, spr))
        compute = None if w.compute_seconds is None else w.compute_seconds[layer]
        if (cause == "straggler" and compute is not None and m["rank_load"] is not None and w.layer_seconds is not None
                and compute.max() > 0 and np.all(compute > 0)):
            # Aurora on uneven devices: load in proportion to each rank's speed, heaviest to fastest.
            speed = np.asarray(m["rank_load"], dtype=np.float64) / compute
            balanced_time = float(np.sum(m["rank_load"]) / speed.sum())
            compute_share = float(compute.max() / max(w.layer_seconds[layer].max(), 1e-12))
            gain = max(gain or 0.0, compute_share * (1.0 - balanced_time / float(compute.max())))
        if cause == "placement":
            cross, expected = m["cross_rank_ratio"], m["expected_cross_rank_ratio"]
            gain = max(gain or 0.0, share * (cross - expected) / max(cross, 1e-9))
        actions.append(Action("placement", gain,
                              "Re-solve the expert placement (moewatch plan): balance rank load"
                              + (" and co-locate experts tokens use together." if cause == "placement" else "."),
                              {}))

    if overflow:
        value = min(_round_up(capacity_for_overflow(w.expert_tokens[layer], t.overflow_target)), t.max_capacity_factor)
        current = float(w.capacity_factor[layer])
        value = max(value, current)
        left = overflow_at_capacity(w.expert_tokens[layer], value)
        actions.append(Action("capacity", 0.0,
                              f"Raise the capacity factor from {current:g} to {value:g}: predicted overflow "
                              f"{m['overflow_rate']:.1%} -> {left:.1%} (more expert memory, no latency gain).",
                              {"value": value, "predicted_overflow": round(left, 4)}))
    elif verdict == IMBALANCE_BOUND and cause == "hot-experts" and now_max is not None:
        # Capping the hot experts levels the ranks, paid for in dropped pairs (never offered on an
        # unknown gain: a lossy action has to show what it buys).
        value = _round_up(capacity_for_overflow(w.expert_tokens[layer], t.overflow_target))
        if value > 0:
            capped = np.minimum(w.expert_tokens[layer], value * w.expert_tokens[layer].mean())
            gain = relief(pack_max_load(capped, W, spr))
            drop = overflow_at_capacity(w.expert_tokens[layer], value)
            actions.append(Action("capacity", gain,
                                  f"Cap experts at capacity factor {value:g}: levels the ranks at the cost of "
                                  f"{drop:.1%} of pairs dropped or rerouted.",
                                  {"value": value, "predicted_overflow": round(drop, 4), "lossy": True}))

    if cause == "small-batch":
        # Fixed per-collective cost is paid per step: doubling the batch halves it per token.
        actions.append(Action("batch", share * 0.5,
                              "Raise the batch (or chunked-prefill size) to amortise per-collective cost; "
                              "it adds queueing delay, so check TTFT against its SLO.", {"factor": 2}))
    # Actions that drop pairs trade model quality for speed: an operator opts into them, so they rank
    # after every lossless action whatever their gain. An unknown gain ranks after the known ones.
    # An action predicted to save under 1 % is noise, except a capacity raise: it cures drops, not time.
    actions = [a for a in actions if a.predicted_gain is None or a.predicted_gain >= 0.01
               or (a.kind == "capacity" and overflow)]
    actions.sort(key=lambda a: (bool(a.params.get("lossy")), a.predicted_gain is None, -(a.predicted_gain or 0.0)))
    return actions


def diagnose(w: Window, t: Thresholds | None = None) -> WindowDiagnosis:
    """Triage every layer of a window and summarise it."""
    t = t or Thresholds()
    metrics = layer_metrics(w, t)
    missing = w.missing_evidence
    layers = [diagnose_layer(w, i, m, t, missing) for i, m in enumerate(metrics)]
    identity = {"schema": "moewatch.diagnosis/v1", "runtime": w.runtime, "model": w.model,
                "ep_group": w.ep_group, "epoch": w.epoch, "world_size": w.world_size,
                "num_layers": w.num_layers, "num_experts": w.num_experts, "num_slots": w.num_slots,
                "steps": w.steps, "start_time": w.start_time, "end_time": w.end_time}
    return WindowDiagnosis(identity, layers, summarise(w, layers, t))


def summarise(w: Window, layers: list[LayerDiagnosis], t: Thresholds) -> dict[str, Any]:
    """Worst layers first, the slowest rank, experts hot in many layers, verdict counts, and the
    evidence the window lacked (`missing` kinds, `absent_fields`)."""
    ranked = sorted(layers, key=_severity_key)
    slowest: dict[str, Any] = {"rank": None, "compute_share": None, "compute_seconds": None}
    if w.compute_seconds is not None:
        compute_by_rank = w.compute_seconds.sum(axis=0)
        rank = int(np.argmax(compute_by_rank))
        total = float(compute_by_rank.sum())
        slowest = {"rank": rank,
                   "compute_share": _finite(float(compute_by_rank[rank]) / total) if total > 0 else None,
                   "compute_seconds": _finite(float(compute_by_rank[rank]))}
    hot_counts = Counter(e for d in layers for e in d.metrics["hot_experts"])
    balanced = tm.balancedness(w)
    steps = w.step_seconds
    timed = steps is not None and len(steps) > 0
    return {
        "verdicts": {v: sum(d.verdict == v for d in layers) for v in VERDICTS},
        "overflow_layers": [d.layer for d in layers if d.overflow],
        "worst_layers": [d.layer for d in ranked if d.verdict != HEALTHY or d.overflow][:10],
        "slowest_rank": slowest,
        "hot_experts_across_layers": [{"expert": int(e), "layers": n} for e, n in hot_counts.most_common(10)],
        "balancedness_mean": None if balanced is None else _finite(float(np.mean(balanced))),
        "step_p50_seconds": _finite(float(np.percentile(steps, 50))) if timed else None,
        "step_p99_seconds": _finite(float(np.percentile(steps, 99))) if timed else None,
        "tokens_per_second": (_finite(float(w.step_tokens.sum() / steps.sum()))
                              if timed and w.step_tokens is not None and steps.sum() > 0 else None),
        "missing": w.missing_evidence,
        "absent_fields": w.absent_fields,
    }
