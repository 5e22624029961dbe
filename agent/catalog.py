"""Every metric the agent exports: name, type, labels, unit and meaning, in one place.

The Prometheus collectors and the OpenTelemetry instruments are built from this list; the alert
rules (alerts/*.yml) and dashboards (dashboards/generate.py --check) are checked against it, and a
test checks the live /metrics output against it. Names follow Prometheus conventions: `moewatch_`
prefix, base units (`_seconds`, `_bytes`, `_ratio` for 0-1 shares), counters end in `_total`.
A name here is a contract with operators' alerts and dashboards: add freely, never rename.

Per-layer series are aggregates (one per layer, or layer x rank); per-expert series exist only when
the operator enables them, under a cap (REFERENCE.md: 61 x 256 experts is 15,616 series per model).
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP = ("model", "ep_group")
LAYER = (*GROUP, "layer")


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as exposed (counters include _total; histograms are the base name)
    kind: str  # gauge | counter | histogram
    labels: tuple[str, ...]
    help: str


# Buckets for the per-step all-to-all time histogram: the seeds' 5 ms p99 threshold sits inside.
A2A_STEP_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1)
# Buckets for an expert's load over the layer's mean expert load (1.0 = average).
EXPERT_LOAD_SHARE_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

METRICS: tuple[MetricSpec, ...] = (
    # --- per layer, from the latest window (gauges) and accumulated over windows (counters)
    MetricSpec("moewatch_layer_a2a_share_ratio", "gauge", LAYER,
               "All-to-all (dispatch + combine) share of layer time, summed over ranks."),
    MetricSpec("moewatch_layer_dispatch_seconds", "gauge", LAYER,
               "Dispatch all-to-all time per step, slowest rank."),
    MetricSpec("moewatch_layer_combine_seconds", "gauge", LAYER,
               "Combine all-to-all time per step, slowest rank."),
    MetricSpec("moewatch_layer_compute_seconds", "gauge", LAYER,
               "Expert compute time per step, slowest rank."),
    MetricSpec("moewatch_layer_seconds", "gauge", LAYER, "Whole MoE layer time per step, slowest rank."),
    MetricSpec("moewatch_layer_a2a_step_seconds", "histogram", LAYER,
               "All-to-all time per step (one observation per window: the window's per-step mean)."),
    MetricSpec("moewatch_layer_rank_load_max_mean_ratio", "gauge", LAYER,
               "Busiest rank's pairs over the mean rank's (1 = balanced)."),
    MetricSpec("moewatch_layer_rank_load_max_min_ratio", "gauge", LAYER,
               "Busiest rank's pairs over the idlest rank's (+Inf when a rank computed nothing)."),
    MetricSpec("moewatch_layer_rank_load_cv_ratio", "gauge", LAYER, "Std/mean of per-rank pairs (seed: < 0.3)."),
    MetricSpec("moewatch_layer_expert_load_cv_ratio", "gauge", LAYER,
               "Std/mean of pairs routed per logical expert (seed: < 0.3)."),
    MetricSpec("moewatch_layer_cross_rank_ratio", "gauge", LAYER, "Share of pairs computed on another rank."),
    MetricSpec("moewatch_layer_cross_node_ratio", "gauge", LAYER,
               "Share of pairs computed on another node, over the inter-node link (0 on one node; "
               "absent when the window carries no rank-to-rank traffic)."),
    MetricSpec("moewatch_layer_expected_cross_node_ratio", "gauge", LAYER,
               "Cross-node share the placement predicts for the observed expert load."),
    MetricSpec("moewatch_layer_seconds_at_stake", "gauge", LAYER,
               "Seconds per step the layer's best action is predicted to save (the triage's ranking key)."),
    MetricSpec("moewatch_layer_expected_cross_rank_ratio", "gauge", LAYER,
               "Cross-rank share the placement predicts for the observed expert load."),
    MetricSpec("moewatch_layer_overflow_ratio", "gauge", LAYER,
               "Share of routed pairs dropped or rerouted by capacity (seed: < 5 %)."),
    MetricSpec("moewatch_layer_routed_pairs_total", "counter", LAYER, "Pairs routed (before capacity)."),
    MetricSpec("moewatch_layer_dropped_pairs_total", "counter", LAYER, "Pairs dropped by capacity (seed: 0)."),
    MetricSpec("moewatch_layer_rerouted_pairs_total", "counter", LAYER,
               "Pairs moved to another expert by capacity."),
    MetricSpec("moewatch_layer_capacity_factor", "gauge", LAYER, "Capacity factor in force (0 = dropless)."),
    MetricSpec("moewatch_layer_effective_capacity_factor", "gauge", LAYER,
               "Computed pairs over granted capacity (seed: > 0.8); absent when dropless."),
    MetricSpec("moewatch_layer_balancedness_ratio", "gauge", LAYER,
               "Mean over max of per-rank pairs (1 = balanced; vLLM/SGLang convention)."),
    MetricSpec("moewatch_layer_a2a_efficiency_ratio", "gauge", LAYER,
               "Aurora lower bound over measured all-to-all time (1 = at the bound)."),
    MetricSpec("moewatch_layer_verdict", "gauge", (*LAYER, "verdict", "cause"),
               "1 for the layer's current verdict and cause, 0 for the others it had."),
    MetricSpec("moewatch_layer_evidence_missing", "gauge", (*LAYER, "evidence"),
               "1 when the layer's latest window lacked this evidence (a2a_time, rank_load, cross_rank, capacity, "
               "compute_time, layer_time, steps, expert_load): that triage step was unknown and its series are "
               "absent; 0 when measured."),
    MetricSpec("moewatch_layer_expert_load_share", "histogram", LAYER,
               "Each expert's pairs over the layer's mean expert pairs, one observation per expert per window "
               "(a heatmap of routing skew)."),
    # --- per rank
    MetricSpec("moewatch_rank_load_pairs", "gauge", (*LAYER, "rank"), "Pairs the rank computed per step."),
    MetricSpec("moewatch_rank_compute_seconds", "gauge", (*GROUP, "rank"),
               "Expert compute time per step over all layers."),
    # --- per expert, only when enabled, capped
    MetricSpec("moewatch_expert_pairs_total", "counter", (*LAYER, "expert"),
               "Pairs routed to one logical expert (enabled by expert_metrics; capped)."),
    MetricSpec("moewatch_expert_series_dropped", "gauge", GROUP,
               "Per-expert series left out because of the cap."),
    # --- per EP group
    MetricSpec("moewatch_epoch", "gauge", GROUP, "Placement epoch in force (from the latest window)."),
    MetricSpec("moewatch_step_seconds", "histogram", GROUP, "Forward step wall time (every step of every window)."),
    MetricSpec("moewatch_tokens_total", "counter", GROUP, "Tokens processed."),
    MetricSpec("moewatch_windows_total", "counter", GROUP, "Windows accepted."),
    MetricSpec("moewatch_last_window_timestamp_seconds", "gauge", GROUP, "Unix time the latest window ended."),
    MetricSpec("moewatch_runtime_connected", "gauge", GROUP, "1 while a runtime of the group is connected."),
    MetricSpec("moewatch_runtime_frames_dropped_total", "counter", GROUP,
               "Frames the runtime's probe dropped because the agent was absent or slow."),
    MetricSpec("moewatch_actions_total", "counter", (*GROUP, "kind", "result"),
               "Decisions by kind (replicate, capacity, placement, rollback) and result "
               "(recommended, applied, skipped, failed, rolled_back)."),
    MetricSpec("moewatch_rollbacks_total", "counter", GROUP, "Plans rolled back after verification."),
    MetricSpec("moewatch_layer_unhealthy_windows", "gauge", LAYER,
               "Consecutive windows with a verdict other than healthy."),
    # --- per EP group, the engine's own SLO signals over the latest scrape interval (slo: section)
    MetricSpec("moewatch_slo_latency_seconds", "gauge", (*GROUP, "signal", "percentile"),
               "The engine's latency percentile over the latest scrape interval, from its histogram buckets "
               "(signal: ttft, itl, tpot, e2e, queue; percentile: p50, p90, p99)."),
    MetricSpec("moewatch_slo_requests", "gauge", (*GROUP, "state"),
               "The engine's requests by state (running, waiting) at the latest scrape."),
    MetricSpec("moewatch_slo_target_seconds", "gauge", (*GROUP, "slo"),
               "The SLO target the agent judges by (ttft_p99, tpot_p99)."),
    MetricSpec("moewatch_slo_breached", "gauge", (*GROUP, "slo"),
               "1 while the SLO (ttft_p99, tpot_p99) is over its target, 0 while met."),
    MetricSpec("moewatch_slo_breached_seconds", "gauge", (*GROUP, "slo"),
               "How long the SLO has been over its target (absent while met)."),
    MetricSpec("moewatch_slo_moe_explained", "gauge", GROUP,
               "While an SLO is breached: 1 when the unhealthy MoE layers' seconds at stake explain it, 0 when "
               "the cause is elsewhere (absent when unknown or nothing is breached)."),
    MetricSpec("moewatch_slo_moe_share_ratio", "gauge", GROUP,
               "While an SLO is breached: the unhealthy MoE layers' seconds at stake per step over the "
               "inter-token latency p99."),
    # --- the agent itself
    MetricSpec("moewatch_frames_received_total", "counter", ("type",), "Frames received, by type."),
    MetricSpec("moewatch_frames_rejected_total", "counter", ("reason",),
               "Frames rejected (malformed, oversized, out_of_order, stale_epoch, invalid_window...)."),
    MetricSpec("moewatch_connections_refused_total", "counter", ("reason",),
               "Runtime connections refused at accept (max_connections, out_of_descriptors) or HTTP "
               "connections refused (http_max_connections)."),
    MetricSpec("moewatch_connections_closed_total", "counter", ("reason",),
               "Runtime connections the agent closed on a peer (slow_reader, frame_deadline, buffer_budget)."),
    MetricSpec("moewatch_groups_retired_total", "counter", (), "EP groups forgotten after their runtime left."),
    MetricSpec("moewatch_job_errors_total", "counter", ("task",), "Scheduled job runs that raised."),
    MetricSpec("moewatch_job_misfires_total", "counter", ("task",), "Scheduled job runs missed."),
    MetricSpec("moewatch_agent_mode", "gauge", ("mode",), "1 for the agent's mode (observe, recommend, act)."),
    MetricSpec("moewatch_agent_info", "gauge", ("version",), "Always 1; carries the agent's version."),
)

BY_NAME = {m.name: m for m in METRICS}


def exposed_names() -> set[str]:
    """Every series name a scrape can show, histograms expanded to _bucket/_sum/_count."""
    names = set()
    for m in METRICS:
        if m.kind == "histogram":
            names.update({f"{m.name}_bucket", f"{m.name}_sum", f"{m.name}_count"})
        else:
            names.add(m.name)
    return names
