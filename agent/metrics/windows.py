"""Families a triaged window writes (per layer, per rank, per expert, per group) and `record_window`,
the one place a window's series are set.

Per-layer series are aggregates (one per layer, or layer x rank); per-expert series exist only when
the operator enables them, under a cap ([measured-cardinality], docs/sources.md: 61 x 256 experts is 15,616 series per model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from moewatch import telemetry as tm
from moewatch.telemetry import Window
from moewatch.triage import WindowDiagnosis

from . import engine_rebalance, slo
from .family import GROUP, LAYER, Counter, Gauge, Histogram, Labels, families_of

if TYPE_CHECKING:
    from .state import MetricsState

# Buckets for the per-step all-to-all time histogram: the 5 ms p99 threshold of [serving-2026] sits inside.
A2A_STEP_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1)
# Buckets for an expert's load over the layer's mean expert load (1.0 = average).
EXPERT_LOAD_SHARE_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# --- per layer, from the latest window (gauges) and accumulated over windows (counters)
LAYER_A2A_SHARE = Gauge("moewatch_layer_a2a_share_ratio", LAYER,
                        "All-to-all (dispatch + combine) share of layer time, summed over ranks.", unit="ratio")
LAYER_A2A_TRANSFER_SHARE = Gauge(
    "moewatch_layer_a2a_transfer_share_ratio", LAYER,
    "Transfer part of the all-to-all share of layer time (triage step 1): the last rank to arrive waits for "
    "nobody, or the runtime's measured waits.", unit="ratio")
LAYER_A2A_WAIT_SHARE = Gauge(
    "moewatch_layer_a2a_wait_share_ratio", LAYER,
    "Share of layer time ranks spend inside the all-to-all waiting for a later rank (a straggler's cost).",
    unit="ratio")
LAYER_TIME_BALANCEDNESS = Gauge(
    "moewatch_layer_time_balancedness_ratio", LAYER,
    "Mean over max of per-rank expert compute time (1 = balanced by time; a plan for a slow rank lowers "
    "plain balancedness and raises this).", unit="ratio")
LAYER_DISPATCH = Gauge("moewatch_layer_dispatch_seconds", LAYER,
                       "Dispatch all-to-all time per step, slowest rank.", unit="seconds")
LAYER_COMBINE = Gauge("moewatch_layer_combine_seconds", LAYER,
                      "Combine all-to-all time per step, slowest rank.", unit="seconds")
LAYER_COMPUTE = Gauge("moewatch_layer_compute_seconds", LAYER,
                      "Expert compute time per step, slowest rank.", unit="seconds")
LAYER_TIME = Gauge("moewatch_layer_seconds", LAYER, "Whole MoE layer time per step, slowest rank.", unit="seconds")
LAYER_A2A_STEP = Histogram("moewatch_layer_a2a_step_seconds", LAYER,
                           "All-to-all time per step (one observation per window: the window's per-step mean).",
                           unit="seconds", buckets=A2A_STEP_BUCKETS)
LAYER_RANK_LOAD_MAX_MEAN = Gauge("moewatch_layer_rank_load_max_mean_ratio", LAYER,
                                 "Busiest rank's pairs over the mean rank's (1 = balanced).", unit="ratio")
LAYER_RANK_LOAD_MAX_MIN = Gauge("moewatch_layer_rank_load_max_min_ratio", LAYER,
                                "Busiest rank's pairs over the idlest rank's (+Inf when a rank computed nothing).",
                                unit="ratio")
LAYER_RANK_LOAD_CV = Gauge("moewatch_layer_rank_load_cv_ratio", LAYER, "Std/mean of per-rank pairs (seed: < 0.3).",
                           unit="ratio")
LAYER_EXPERT_LOAD_CV = Gauge("moewatch_layer_expert_load_cv_ratio", LAYER,
                             "Std/mean of pairs routed per logical expert (seed: < 0.3).", unit="ratio")
LAYER_CROSS_RANK = Gauge("moewatch_layer_cross_rank_ratio", LAYER, "Share of pairs computed on another rank.",
                         unit="ratio")
LAYER_CROSS_NODE = Gauge("moewatch_layer_cross_node_ratio", LAYER,
                         "Share of pairs computed on another node, over the inter-node link (0 on one node; "
                         "absent when the window carries no rank-to-rank traffic).", unit="ratio")
LAYER_EXPECTED_CROSS_NODE = Gauge("moewatch_layer_expected_cross_node_ratio", LAYER,
                                  "Cross-node share the placement predicts for the observed expert load.",
                                  unit="ratio")
LAYER_SECONDS_AT_STAKE = Gauge(
    "moewatch_layer_seconds_at_stake", LAYER,
    "Seconds per step the layer's best action is predicted to save (the triage's ranking key).", unit="seconds")
LAYER_EXPECTED_CROSS_RANK = Gauge("moewatch_layer_expected_cross_rank_ratio", LAYER,
                                  "Cross-rank share the placement predicts for the observed expert load.",
                                  unit="ratio")
LAYER_OVERFLOW = Gauge("moewatch_layer_overflow_ratio", LAYER,
                       "Share of routed pairs dropped or rerouted by capacity (seed: < 5 %).", unit="ratio")
LAYER_ROUTED_PAIRS_TOTAL = Counter("moewatch_layer_routed_pairs_total", LAYER, "Pairs routed (before capacity).")
LAYER_DROPPED_PAIRS_TOTAL = Counter("moewatch_layer_dropped_pairs_total", LAYER,
                                    "Pairs dropped by capacity (seed: 0).")
LAYER_REROUTED_PAIRS_TOTAL = Counter("moewatch_layer_rerouted_pairs_total", LAYER,
                                     "Pairs moved to another expert by capacity.")
LAYER_CAPACITY_FACTOR = Gauge("moewatch_layer_capacity_factor", LAYER, "Capacity factor in force (0 = dropless).")
LAYER_EFFECTIVE_CAPACITY_FACTOR = Gauge("moewatch_layer_effective_capacity_factor", LAYER,
                                        "Computed pairs over granted capacity (seed: > 0.8); absent when dropless.")
LAYER_BALANCEDNESS = Gauge("moewatch_layer_balancedness_ratio", LAYER,
                           "Mean over max of per-rank pairs (1 = balanced; the engines' EPLB convention).", unit="ratio")
LAYER_A2A_EFFICIENCY = Gauge("moewatch_layer_a2a_efficiency_ratio", LAYER,
                             "Aurora lower bound over measured all-to-all time (1 = at the bound).", unit="ratio")
LAYER_VERDICT = Gauge("moewatch_layer_verdict", (*LAYER, "verdict", "cause"),
                      "1 for the layer's current verdict and cause, 0 for the others it had.")
LAYER_EVIDENCE_MISSING = Gauge(
    "moewatch_layer_evidence_missing", (*LAYER, "evidence"),
    "1 when the layer's latest window lacked this evidence (a2a_time, rank_load, cross_rank, capacity, "
    "compute_time, layer_time, steps, expert_load): that triage step was unknown and its series are "
    "absent; or (shards) the merged window lacked some of its group's shards; 0 when measured.")
LAYER_EXPERT_LOAD_SHARE = Histogram(
    "moewatch_layer_expert_load_share", LAYER,
    "Each expert's pairs over the layer's mean expert pairs, one observation per expert per window "
    "(a heatmap of routing skew).", buckets=EXPERT_LOAD_SHARE_BUCKETS)
# --- per rank
RANK_LOAD_PAIRS = Gauge("moewatch_rank_load_pairs", (*LAYER, "rank"), "Pairs the rank computed per step.")
RANK_COMPUTE = Gauge("moewatch_rank_compute_seconds", (*GROUP, "rank"),
                     "Expert compute time per step over all layers.", unit="seconds")
# --- per expert, only when enabled, capped
EXPERT_PAIRS_TOTAL = Counter("moewatch_expert_pairs_total", (*LAYER, "expert"),
                             "Pairs routed to one logical expert (enabled by expert_metrics; capped).")
EXPERT_SERIES_DROPPED = Gauge("moewatch_expert_series_dropped", GROUP,
                              "Per-expert series left out because of the cap.")
# --- per EP group
EPOCH = Gauge("moewatch_epoch", GROUP, "Placement epoch in force (from the latest window).")
STEP_TIME = Histogram("moewatch_step_seconds", GROUP, "Forward step wall time (every step of every window).",
                      unit="seconds", buckets=STEP_BUCKETS)
TOKENS_TOTAL = Counter("moewatch_tokens_total", GROUP, "Tokens processed.")
WINDOWS_TOTAL = Counter("moewatch_windows_total", GROUP, "Windows accepted.")
LAST_WINDOW_TIMESTAMP = Gauge("moewatch_last_window_timestamp_seconds", GROUP, "Unix time the latest window ended.",
                              unit="seconds")
LAYER_UNHEALTHY_WINDOWS = Gauge("moewatch_layer_unhealthy_windows", LAYER,
                                "Consecutive windows with a verdict other than healthy.")

FAMILIES = families_of(globals())


@dataclass
class GroupExportMemory:
    """Per-group bookkeeping the window's series need across windows."""

    verdicts: dict[int, set[tuple[str, str]]] = field(default_factory=dict)  # layer -> (verdict, cause) seen
    unhealthy_run: dict[int, int] = field(default_factory=dict)
    expert_series: set[tuple[int, int]] = field(default_factory=set)
    expert_left_out: set[tuple[int, int]] = field(default_factory=set)
    # Label tuples, built once per group and size: (L, W) -> ([L] layer keys, [L][W] rank keys).
    keys: dict[tuple[int, int], tuple[list[Labels], list[list[Labels]]]] = field(default_factory=dict)
    flat_keys: dict[tuple[int, int], list[Labels]] = field(default_factory=dict)  # (L, W) -> the rank keys, flat

    def labels(self, group: tuple[str, str], num_layers: int, world_size: int
               ) -> tuple[list[Labels], list[list[Labels]]]:
        found = self.keys.get((num_layers, world_size))
        if found is None:
            layers = [(*group, str(layer)) for layer in range(num_layers)]
            ranks = [[(*key, str(rank)) for rank in range(world_size)] for key in layers]
            found = self.keys[(num_layers, world_size)] = (layers, ranks)
        return found

    def flat_rank_labels(self, group: tuple[str, str], num_layers: int, world_size: int) -> list[Labels]:
        """The [L][W] rank keys of `labels` in one list, layer-major (built once per group and size)."""
        found = self.flat_keys.get((num_layers, world_size))
        if found is None:
            rank_keys = self.labels(group, num_layers, world_size)[1]
            found = self.flat_keys[(num_layers, world_size)] = [key for row in rank_keys for key in row]
        return found


# Per-layer gauges and the diagnosis metric each one shows.
LAYER_GAUGES = {
    LAYER_A2A_SHARE: "a2a_share",
    LAYER_A2A_TRANSFER_SHARE: "a2a_transfer_share",
    LAYER_A2A_WAIT_SHARE: "a2a_wait_share",
    LAYER_TIME_BALANCEDNESS: "time_balancedness",
    LAYER_DISPATCH: "dispatch_seconds_per_step",
    LAYER_COMBINE: "combine_seconds_per_step",
    LAYER_COMPUTE: "compute_seconds_per_step",
    LAYER_TIME: "layer_seconds_per_step",
    LAYER_RANK_LOAD_MAX_MEAN: "rank_load_max_mean",
    LAYER_RANK_LOAD_CV: "rank_load_cv",
    LAYER_EXPERT_LOAD_CV: "expert_load_cv",
    LAYER_CROSS_RANK: "cross_rank_ratio",
    LAYER_EXPECTED_CROSS_RANK: "expected_cross_rank_ratio",
    LAYER_CROSS_NODE: "cross_node_ratio",
    LAYER_EXPECTED_CROSS_NODE: "expected_cross_node_ratio",
    LAYER_OVERFLOW: "overflow_rate",
    LAYER_CAPACITY_FACTOR: "capacity_factor",
    LAYER_EFFECTIVE_CAPACITY_FACTOR: "effective_capacity_factor",
    LAYER_BALANCEDNESS: "balancedness",
    LAYER_A2A_EFFICIENCY: "a2a_efficiency",
}


def record_window(state: MetricsState, memory: GroupExportMemory, w: Window, diagnosis: WindowDiagnosis,
                  expert_metrics: bool) -> None:
    """Write one accepted, triaged window into the state (the only place a window's series are set).
    The numbers are the diagnosis's and the window's shared derived quantities (computed once, by
    the triage); a family's series are written in one call. A quantity the window lacks the evidence
    for has no series (a previous window's is removed), and moewatch_layer_evidence_missing says
    which evidence was missing."""
    group = (w.model, w.ep_group)
    engine_rebalance.record_rebalances(state, group, engine_rebalance.records_of(w))
    steps = max(w.steps, 1)
    layer_keys, rank_keys = memory.labels(group, w.num_layers, w.world_size)
    rank_load = tm.rank_load(w)
    max_min = tm.rank_load_max_min(w)
    dropless = w.capacity_factor == 0.0
    for metric, key in LAYER_GAUGES.items():
        present, absent = [], []
        for d in diagnosis.layers:
            value = d.metrics.get(key)
            if value is None or (key == "effective_capacity_factor" and dropless[d.layer]):
                absent.append(layer_keys[d.layer])  # unmeasured, or dropless: no capacity to fill
            else:
                present.append((layer_keys[d.layer], value))
        state[metric].set_many(present, chunk=group)
        state[metric].remove_many(absent)
    state[LAYER_SECONDS_AT_STAKE].set_many([(layer_keys[d.layer], d.seconds_at_stake)
                                            for d in diagnosis.layers if np.isfinite(d.seconds_at_stake)],
                                           chunk=group)
    state[LAYER_EVIDENCE_MISSING].set_many(
        [((*layer_keys[d.layer], kind), 1.0 if kind in d.missing else 0.0)
         for d in diagnosis.layers for kind in tm.EVIDENCE_KINDS], chunk=group)
    if max_min is None:
        state[LAYER_RANK_LOAD_MAX_MIN].remove_many(layer_keys)
        state[RANK_LOAD_PAIRS].remove_many([k for row in rank_keys for k in row])
    else:
        # +Inf here where a rank computed nothing (None in the diagnosis's JSON).
        state[LAYER_RANK_LOAD_MAX_MIN].set_many(zip(layer_keys, max_min.tolist()), chunk=group)
        state[RANK_LOAD_PAIRS].set_columns(memory.flat_rank_labels(group, w.num_layers, w.world_size),
                                           (rank_load / steps).ravel().tolist(), chunk=group)
    for metric, key in ((LAYER_ROUTED_PAIRS_TOTAL, "routed_pairs"),
                        (LAYER_DROPPED_PAIRS_TOTAL, "dropped_pairs"),
                        (LAYER_REROUTED_PAIRS_TOTAL, "rerouted_pairs")):
        state[metric].inc_many([(layer_keys[d.layer], d.metrics[key]) for d in diagnosis.layers
                                if d.metrics[key] is not None], chunk=group)
    # Per-expert series need per-expert counts (a window of per-rank totals has none).
    expert_load = None if w.expert_tokens is None else w.expert_tokens.astype(np.float64)
    if expert_load is not None:
        expert_mean = expert_load.mean(axis=1, keepdims=True)
        expert_share = np.divide(expert_load, expert_mean, out=np.zeros_like(expert_load), where=expert_mean > 0)
    # The group's all-to-all per step: the slowest rank's (a collective ends when its last rank does).
    a2a = [(layer_keys[d.layer], d.metrics["a2a_seconds_per_step"]) for d in diagnosis.layers
           if d.metrics["a2a_seconds_per_step"] is not None]
    if a2a:
        state[LAYER_A2A_STEP].observe_rows([key for key, _ in a2a], np.array([[value] for _, value in a2a]))
    if expert_load is not None:
        shared = [d.layer for d in diagnosis.layers if expert_mean[d.layer, 0] > 0]
        state[LAYER_EXPERT_LOAD_SHARE].observe_rows([layer_keys[i] for i in shared], expert_share[shared])
    verdicts, runs = [], []
    for d in diagnosis.layers:
        layer = layer_keys[d.layer]
        # The verdict gauge: 1 for the current (verdict, cause), 0 for the others this layer had.
        current = (d.verdict, d.cause or "none")
        seen = memory.verdicts.setdefault(d.layer, set())
        seen.add(current)
        verdicts += [((*layer, verdict, cause), 1.0 if (verdict, cause) == current else 0.0) for verdict, cause in seen]
        run = memory.unhealthy_run.get(d.layer, 0)
        run = run + 1 if d.verdict != "healthy" else 0
        memory.unhealthy_run[d.layer] = run
        runs.append((layer, run))
    state[LAYER_VERDICT].set_many(verdicts, chunk=group)
    state[LAYER_UNHEALTHY_WINDOWS].set_many(runs, chunk=group)
    group_ranks = [(*group, str(rank)) for rank in range(w.world_size)]
    if w.compute_seconds is None:
        state[RANK_COMPUTE].remove_many(group_ranks)
    else:
        state[RANK_COMPUTE].set_many(zip(group_ranks, (w.compute_seconds.sum(axis=0) / steps).tolist()), chunk=group)
    if expert_metrics and expert_load is not None:
        _record_experts(state, memory, w, group)
    state[EPOCH].set(group, w.epoch)
    if w.step_seconds is not None:
        state[STEP_TIME].observe(group, w.step_seconds)
    if w.step_tokens is not None:
        state[TOKENS_TOTAL].inc(group, int(w.step_tokens.sum()))
    state[WINDOWS_TOTAL].inc(group)
    state[LAST_WINDOW_TIMESTAMP].set(group, w.end_time)
    slo.record_slo(state, group, diagnosis.summary.get("slo"))
    state.window_recorded()


def _record_experts(state: MetricsState, memory: GroupExportMemory, w: Window, group: tuple[str, str]) -> None:
    cap = state.expert_series_cap
    counts = w.expert_tokens.tolist()
    items = []
    for layer in range(w.num_layers):
        for expert in range(w.num_experts):
            key = (layer, expert)
            if key not in memory.expert_series:
                if len(memory.expert_series) >= cap:
                    memory.expert_left_out.add(key)
                    continue
                memory.expert_series.add(key)
            items.append(((*group, str(layer), str(expert)), counts[layer][expert]))
    state[EXPERT_PAIRS_TOTAL].inc_many(items)
    state[EXPERT_SERIES_DROPPED].set(group, len(memory.expert_left_out))

