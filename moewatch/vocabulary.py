"""The words moewatch emits, in one place: verdicts, causes, action and decision kinds, decision
results, evidence kinds, and the colour each verdict is shown in. The triage, the agent, the exporter
catalogue, the dashboards and the docs take their values from here; a test fails when the agent
counts a value this module does not list.
"""

from __future__ import annotations

# --- the triage ---------------------------------------------------------------------------------
HEALTHY, COMM_BOUND, IMBALANCE_BOUND = "healthy", "comm-bound", "imbalance-bound"
VERDICTS = (HEALTHY, COMM_BOUND, IMBALANCE_BOUND)
# comm-bound: volume, placement, small-batch; imbalance-bound: hot-experts, straggler (docs/triage.md).
CAUSES = ("volume", "placement", "small-batch", "hot-experts", "straggler")
# What the triage proposes for a layer.
ACTION_KINDS = ("replicate", "capacity", "placement", "batch", "schedule")
# What a window may lack (telemetry.EVIDENCE, by the same names, says which fields each needs).
# `shards`: a merged window that lacks some of its group's shards (its counts cover the rest only).
EVIDENCE_KINDS = ("a2a_time", "rank_load", "cross_rank", "capacity", "compute_time", "layer_time", "steps",
                  "expert_load", "shards")

# --- the agent ----------------------------------------------------------------------------------
# What the agent decides about: the triage's actions, and undoing a plan.
DECISION_KINDS = ("replicate", "placement", "capacity", "batch", "schedule", "rollback")
RECOMMENDED = "recommended"  # said, not sent (recommend mode, or an engine that takes no plan)
PROPOSED = "proposed"  # folded into the plan about to be sent (audited, counted once it is applied)
SKIPPED = "skipped"  # a guardrail said no; the reason says which
APPLIED = "applied"  # the runtime acknowledged the plan
FAILED = "failed"  # the runtime refused it, failed to apply it, or never answered
ROLLED_BACK = "rolled_back"  # verification found the layer worse and the old placement came back
ABANDONED = "abandoned"  # its runtime went away (or restarted) before the plan finished
DECISION_RESULTS = (RECOMMENDED, PROPOSED, SKIPPED, APPLIED, FAILED, ROLLED_BACK, ABANDONED)
# The results moewatch_actions_total counts (a proposed decision is counted by what becomes of it).
COUNTED_RESULTS = tuple(r for r in DECISION_RESULTS if r != PROPOSED)
# moewatch_rollbacks_total counts the same events as actions_total{kind="rollback", result="applied"}.
ROLLBACK_APPLIED = ("rollback", APPLIED)

# --- colours, per medium (the same hue for a verdict everywhere) --------------------------------
TERMINAL_COLOURS = {HEALTHY: "green", COMM_BOUND: "yellow", IMBALANCE_BOUND: "red"}  # click.style names
HEX_COLOURS = {HEALTHY: "#4c9a2a", COMM_BOUND: "#e0a800", IMBALANCE_BOUND: "#c62828"}  # matplotlib report
GRAFANA_COLOURS = {HEALTHY: "green", COMM_BOUND: "orange", IMBALANCE_BOUND: "red"}  # dashboard value maps
