"""Write moewatch's Grafana dashboards from Python (grafana-foundation-sdk), or check them.

    python dashboards/generate.py            write dashboards/json/*.json
    python dashboards/generate.py --check    exit 1 when the committed JSON differs from what this
                                             script writes, when a query names a metric that is neither
                                             in agent/catalog.py nor a recording rule in alerts/*.yml,
                                             or when a query does not parse (promtool check rules)

Three dashboards: the overview (verdict per layer, worst layers, step time, actions), the layer
drill-down (one layer: all-to-all against compute, rank load, expert-load heatmap, cross-rank ratio,
Aurora efficiency, capacity and overflow) and the agent's own health.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import yaml
from grafana_foundation_sdk.builders import bargauge, common as common_b, dashboard as dash_b
from grafana_foundation_sdk.builders import heatmap, prometheus, stat, statetimeline, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common, dashboard as dash_m
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from moewatch.agent import catalog
from moewatch.thresholds import Thresholds
from moewatch.vocabulary import COUNTED_RESULTS, GRAFANA_COLOURS, VERDICTS

ROOT = Path(__file__).resolve().parents[1]
JSON_DIR = ROOT / "dashboards" / "json"
RULES_GLOB = "alerts/*.yml"

# Series Prometheus itself makes for every target: queries may name them too.
PROMETHEUS_SERIES = {"up"}
# Grafana's built-in variables, and what each becomes when a query is parsed.
GRAFANA_BUILTINS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h", "__range_s": "3600",
                    "__range_ms": "3600000", "__interval_ms": "60000"}

T = Thresholds()
DS = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
GROUP_SEL = 'model=~"$model", ep_group=~"$ep_group"'
LAYER_SEL = f'{GROUP_SEL}, layer="$layer"'
VERDICT_MAPPINGS = [dash_m.ValueMap(options={
    str(i): dash_m.ValueMappingResult(text=verdict, color=GRAFANA_COLOURS[verdict], index=i)
    for i, verdict in enumerate(VERDICTS)
})]


# --- building blocks ----------------------------------------------------------------------------

def query(expr: str, legend: str, ref: str, instant: bool = False,
          fmt: PromQueryFormat | None = None) -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DS)
    if instant:
        q = q.instant()
    if fmt is not None:
        q = q.format(fmt)
    return q


def thresholds(*steps: tuple[float | None, str]) -> dash_b.ThresholdsConfig:
    return (dash_b.ThresholdsConfig().mode(dash_m.ThresholdsMode.ABSOLUTE)
            .steps([dash_m.Threshold(value=v, color=c) for v, c in steps]))


def series_panel(title: str, description: str, unit: str, queries: list[prometheus.Dataquery],
                 width: int = 12, height: int = 8, limit: float | None = None) -> timeseries.Panel:
    """A time series; `limit` draws the threshold the alerts use as a dashed red line."""
    panel = (timeseries.Panel().title(title).description(description).unit(unit).datasource(DS)
             .span(width).height(height).targets(queries).fill_opacity(10)
             .legend(common_b.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
                     .placement(common.LegendPlacement.BOTTOM).show_legend(True)))
    if limit is not None:
        panel = (panel.thresholds(thresholds((None, "transparent"), (limit, "red")))
                 .thresholds_style(common_b.GraphThresholdsStyleConfig()
                                   .mode(common.GraphThresholdsStyleMode.DASHED)))
    return panel


def stat_panel(title: str, description: str, unit: str, q: prometheus.Dataquery, width: int = 4,
               steps: tuple[tuple[float | None, str], ...] = ((None, "green"),)) -> stat.Panel:
    return (stat.Panel().title(title).description(description).unit(unit).datasource(DS).span(width)
            .height(4).with_target(q).thresholds(thresholds(*steps))
            .color_mode(common.BigValueColorMode.VALUE).graph_mode(common.BigValueGraphMode.AREA))


def variables(with_layer: bool) -> list:
    out = [
        dash_b.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        dash_b.QueryVariable("model").label("Model").datasource(DS)
        .query("label_values(moewatch_windows_total, model)")
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dash_m.VariableSort.ALPHABETICAL_ASC)
        .include_all(not with_layer).multi(not with_layer),
        dash_b.QueryVariable("ep_group").label("EP group").datasource(DS)
        .query('label_values(moewatch_windows_total{model=~"$model"}, ep_group)')
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dash_m.VariableSort.ALPHABETICAL_ASC)
        .include_all(not with_layer).multi(not with_layer),
    ]
    if with_layer:
        out.append(dash_b.QueryVariable("layer").label("Layer").datasource(DS)
                   .query(f"label_values(moewatch_layer_seconds{{{GROUP_SEL}}}, layer)")
                   .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
                   .sort(dash_m.VariableSort.NUMERICAL_ASC))
    return out


def base(uid: str, title: str, description: str) -> dash_b.Dashboard:
    return (dash_b.Dashboard(title).uid(uid).description(description).tags(["moewatch", "moe"])
            .time("now-1h", "now").refresh("30s").timezone("browser").editable()
            .tooltip(dash_m.DashboardCursorSync.CROSSHAIR)
            .link(dash_b.DashboardLink("moewatch").type(dash_m.DashboardLinkType.DASHBOARDS)
                  .tags(["moewatch"]).as_dropdown(True).include_vars(True).keep_time(True)))


def with_panels(board: dash_b.Dashboard, rows: list[tuple[str, list[Any]]]) -> dash_b.Dashboard:
    """Rows of panels, ids numbered in order so the JSON is stable."""
    panel_id = 0
    for title, panels in rows:
        panel_id += 1
        board = board.with_row(dash_b.Row(title).id(panel_id))
        for panel in panels:
            panel_id += 1
            board = board.with_panel(panel.id(panel_id))
    return board


# --- the three dashboards -----------------------------------------------------------------------

def overview() -> dash_b.Dashboard:
    verdicts = (statetimeline.Panel().title("Verdict per layer")
                .description("The triage verdict of every MoE layer, window by window (docs/triage.md). "
                             "Click a layer to open its drill-down.")
                .datasource(DS).span(24).height(14).mappings(VERDICT_MAPPINGS)
                .with_target(query(f"layer:moewatch_layer_verdict:code{{{GROUP_SEL}}}",
                                   "{{ep_group}} layer {{layer}}", "A"))
                .show_value(common.VisibilityMode.NEVER).merge_values(True).fill_opacity(80)
                .data_links([dash_b.DashboardLink("Open layer ${__field.labels.layer}").type(
                    dash_m.DashboardLinkType.LINK).url(
                    "/d/moewatch-layer?var-datasource=${datasource}&var-model=${__field.labels.model}"
                    "&var-ep_group=${__field.labels.ep_group}&var-layer=${__field.labels.layer}&${__url_time_range}")]))
    worst_unhealthy = (bargauge.Panel().title("Longest-unhealthy layers")
                       .description("Consecutive windows with a verdict other than healthy, top 10.")
                       .datasource(DS).span(12).height(8).unit("short").min(0)
                       .with_target(query(f"topk(10, max by (model, ep_group, layer) "
                                          f"(moewatch_layer_unhealthy_windows{{{GROUP_SEL}}}) > 0)",
                                          "layer {{layer}}", "A", instant=True))
                       .display_mode(common.BarGaugeDisplayMode.GRADIENT)
                       .orientation(common.VizOrientation.HORIZONTAL)
                       .thresholds(thresholds((None, "orange"), (30, "red"))))
    worst_a2a = (bargauge.Panel().title("Slowest all-to-all (p99 per step, 5m)")
                 .description(f"Layers whose all-to-all p99 is highest, top 10; [serving-2026] holds it under "
                              f"{T.a2a_p99_seconds * 1e3:g} ms per layer.")
                 .datasource(DS).span(12).height(8).unit("s").min(0)
                 .with_target(query(f"topk(10, layer:moewatch_layer_a2a_step_seconds:p99_5m{{{GROUP_SEL}}})",
                                    "layer {{layer}}", "A", instant=True))
                 .display_mode(common.BarGaugeDisplayMode.GRADIENT)
                 .orientation(common.VizOrientation.HORIZONTAL)
                 .thresholds(thresholds((None, "green"), (T.a2a_p99_seconds, "red"))))
    step = series_panel(
        "Step time p50 and p99", "Forward step wall time over every step of every window (5m).", "s",
        [query(f"group:moewatch_step_seconds:p50_5m{{{GROUP_SEL}}}", "p50 {{model}}/{{ep_group}}", "A"),
         query(f"group:moewatch_step_seconds:p99_5m{{{GROUP_SEL}}}", "p99 {{model}}/{{ep_group}}", "B")])
    tokens = series_panel(
        "Tokens per second", "Tokens the EP group processed.", "short",
        [query(f"sum by (model, ep_group) (rate(moewatch_tokens_total{{{GROUP_SEL}}}[$__rate_interval]))",
               "{{model}}/{{ep_group}}", "A")])
    actions = (series_panel(
        "Actions by kind and result", f"What the agent decided ({', '.join(COUNTED_RESULTS)}) per kind, per interval.",
        "short",
        [query(f"sum by (kind, result) (increase(moewatch_actions_total{{{GROUP_SEL}}}[$__rate_interval]))",
               "{{kind}} {{result}}", "A")])
        .draw_style(common.GraphDrawStyle.BARS).stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL)))
    rollbacks = (series_panel(
        "Rollbacks", "Plans rolled back after verification found the layer worse.", "short",
        [query(f"sum by (model, ep_group) (increase(moewatch_rollbacks_total{{{GROUP_SEL}}}[$__rate_interval]))",
               "{{model}}/{{ep_group}}", "A")])
        .draw_style(common.GraphDrawStyle.BARS))
    header = [
        stat_panel("Unhealthy layers", "Layers whose latest verdict is not healthy.", "short",
                   query(f"sum(group:moewatch_layers_unhealthy:count{{{GROUP_SEL}}})", "", "A"),
                   steps=((None, "green"), (1, "orange"))),
        stat_panel("Step p50", "Forward step time, median over the last 5 minutes.", "s",
                   query(f"max(group:moewatch_step_seconds:p50_5m{{{GROUP_SEL}}})", "", "A")),
        stat_panel("Step p99", "Forward step time, 99th percentile over the last 5 minutes.", "s",
                   query(f"max(group:moewatch_step_seconds:p99_5m{{{GROUP_SEL}}})", "", "A")),
        stat_panel("Placement epoch", "Epoch of the placement in force.", "none",
                   query(f"max(moewatch_epoch{{{GROUP_SEL}}})", "", "A")),
        stat_panel("Actions applied (range)", "Plans the agent applied over the dashboard's range.", "short",
                   query(f'sum(increase(moewatch_actions_total{{{GROUP_SEL}, result="applied"}}[$__range]))', "", "A")),
        stat_panel("Rollbacks (range)", "Plans rolled back over the dashboard's range.", "short",
                   query(f"sum(increase(moewatch_rollbacks_total{{{GROUP_SEL}}}[$__range]))", "", "A"),
                   steps=((None, "green"), (1, "orange"))),
    ]
    board = base("moewatch-overview", "moewatch / overview",
                 "Every MoE layer's verdict, the worst layers, step time and what the agent did about it.")
    slo = slo_panels()
    return with_panels(board.variables(variables(with_layer=False)), [
        ("Fleet: where the time is", fleet_panels()),
        ("Now", header),
        ("Layers", [verdicts, worst_unhealthy, worst_a2a]),
        ("Serving", [step, tokens]),
        ("Engine SLOs and their MoE attribution", slo),
        ("Agent decisions", [actions, rollbacks]),
        ("Engine rebalancing with moewatch's policy (MOEWATCH_EPLB=1)", engine_rebalance_panels()),
        ("Engine rebalancing: still happening, and what it stalls", rebalance_watch_panels()),
        ("Rebalance ledger: did each rebalance pay?", ledger_panels()),
        ("Sharded groups (one shard per DP rank)", shard_panels()),
    ])


def increase_bars(title: str, description: str, counter: str, by: str, legend: str) -> timeseries.Panel:
    """A third-wide bar chart of a counter's increase per interval, summed by `by`."""
    return series_panel(title, description, "short",
                        [query(f"sum by ({by}) (increase({counter}{{{GROUP_SEL}}}[$__rate_interval]))", legend, "A")],
                        width=8).draw_style(common.GraphDrawStyle.BARS)


def engine_rebalance_panels() -> list[Any]:
    """vLLM's or SGLang's own EPLB calling moewatch's policy (docs/integrations.md): what each call did,
    what it predicted, and how the next window judged it. Empty where the policy is off."""
    calls = increase_bars(
        "Engine rebalance calls", "Calls the engine made to moewatch's policy, per interval: decided by it, or "
        "(fallback) answered by the engine's own algorithm after an error (the audit log has the error).",
        "moewatch_engine_rebalance_calls_total", "engine, result", "{{engine}} {{result}}")
    layers = increase_bars(
        "Layers per rebalance by outcome", "Moved (the full mending), moved_less (a shorter one that paid), "
        "placed afresh, or kept: no better, not paying for its stall, no load.",
        "moewatch_engine_rebalance_layers_total", "outcome", "{{outcome}}").stacking(
        common_b.StackingConfig().mode(common.StackingMode.NORMAL))
    slots = increase_bars(
        "Slots moved", "Slots whose expert the engine's rebalances changed, as moewatch's policy decided: the "
        "expert weights the engine copied.", "moewatch_engine_rebalance_experts_moved_total", "model, ep_group",
        "{{model}}/{{ep_group}}")
    balance = series_panel(
        "Predicted balancedness of the latest rebalance", "Mean over layers of mean / max GPU load on the window "
        "the policy was given: before, the planner's proposal, and after (what the cost gate kept).", "percentunit",
        [query(f"moewatch_engine_rebalance_balancedness_ratio{{{GROUP_SEL}}}", "{{phase}} {{model}}/{{ep_group}}",
               "A")], width=8)
    cost = series_panel(
        "Predicted stall and call time", "The latest rebalance's predicted stall (its moved slots' bytes over the "
        "links, MOEWATCH_EPLB_* prices) and how long the policy call took inside the engine.", "s",
        [query(f"moewatch_engine_rebalance_predicted_stall_seconds{{{GROUP_SEL}}}", "stall {{model}}/{{ep_group}}",
               "A"),
         query(f"moewatch_engine_rebalance_solve_seconds{{{GROUP_SEL}}}", "call {{model}}/{{ep_group}}", "B")],
        width=8)
    checked = (series_panel(
        "Checked on the next window", "Each rebalance's moved layers against the window before it: not_worse, "
        "or worse (measured balancedness fell by more than verify.rollback_balancedness_drop; alert "
        "MoewatchEngineRebalanceWorse), and how many layers were worse.", "short",
        [query(f"sum by (verdict) (increase(moewatch_engine_rebalance_verdicts_total{{{GROUP_SEL}}}"
               f"[$__rate_interval]))", "{{verdict}}", "A"),
         query(f"sum by (model, ep_group) (increase(moewatch_engine_rebalance_layers_worse_total{{{GROUP_SEL}}}"
               f"[$__rate_interval]))", "layers worse {{model}}/{{ep_group}}", "B")], width=8)
        .draw_style(common.GraphDrawStyle.BARS))
    return [calls, layers, slots, balance, cost, checked]


def rebalance_watch_panels() -> list[Any]:
    """The watch on the engine's own rebalancing (docs/integrations.md, "Watching the engine's own
    rebalancing"): steps since the last rebalance against the overdue line, and each rebalance's stall.
    Empty where the engine's rebalancing is off."""
    since = series_panel(
        "Steps since the last rebalance", "Forward steps the engine ran since the agent last saw one of its "
        "rebalances, against two of its configured intervals: above that line the rebalancing has stopped "
        "(moewatch_engine_rebalance_overdue; alert MoewatchEngineRebalanceOverdue).", "short",
        [query(f"moewatch_engine_rebalance_steps_since_last{{{GROUP_SEL}}}", "since {{model}}/{{ep_group}}", "A"),
         query(f"2 * moewatch_engine_rebalance_interval_steps{{{GROUP_SEL}}}", "overdue above {{model}}/{{ep_group}}",
               "B")], width=12)
    stall = series_panel(
        "Step stall per rebalance", "Mean over the interval's rebalances of how much longer the longest step of "
        "the window that carried each ran than its median step (alert MoewatchEngineRebalanceSlow over 1 s).", "s",
        [query(f"increase(moewatch_engine_rebalance_step_stall_seconds_sum{{{GROUP_SEL}}}[$__rate_interval]) / "
               f"increase(moewatch_engine_rebalance_step_stall_seconds_count{{{GROUP_SEL}}}[$__rate_interval])",
               "{{model}}/{{ep_group}}", "A")], width=12).draw_style(common.GraphDrawStyle.POINTS)
    return [since, stall]


def ledger_panels() -> list[Any]:
    """The rebalance ledger (docs/eplb-advice.md, "The ledger: reading a rebalance"): each settled rebalance,
    whoever's policy made it, paid or not, its stall against its gain, net and break-even."""
    outcomes = increase_bars(
        "Rebalances by policy and outcome", "Rebalances the ledger settled per interval, by whose policy made them "
        "(engine_own, moewatch_in_engine, agent_plan, agent_rollback) and whether they paid (net seconds > 0), "
        "did_not_pay, or are unknown (no step times).", "moewatch_rebalance_ledger_entries_total",
        "policy, outcome", "{{policy}} {{outcome}}").stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL))
    net = series_panel(
        "Net seconds of the latest rebalance", "Gain per step x steps until the next rebalance (or the configured "
        "interval, or the steps seen since) - stall. Below zero the rebalance cost more than it bought.", "s",
        [query(f"moewatch_rebalance_ledger_net_seconds{{{GROUP_SEL}}}", "{{policy}} {{model}}/{{ep_group}}", "A")],
        width=8).draw_style(common.GraphDrawStyle.POINTS)
    stall_gain = series_panel(
        "Stall and gain per step", "The latest rebalance's stall (step time beyond the pace before while weights "
        "moved, plus a runtime's wait between steps) and its gain per step (pace before - after).", "s",
        [query(f"moewatch_rebalance_ledger_stall_seconds{{{GROUP_SEL}}}", "stall {{policy}} {{model}}/{{ep_group}}",
               "A"),
         query(f"moewatch_rebalance_ledger_gain_per_step_seconds{{{GROUP_SEL}}}",
               "gain/step {{policy}} {{model}}/{{ep_group}}", "B")], width=8).draw_style(common.GraphDrawStyle.POINTS)
    even = series_panel(
        "Break-even against the horizon", "Steps the new map must serve to pay back its stall (absent: it gained "
        "nothing) against the steps it had until the next rebalance: a break-even above the horizon did not pay.",
        "short",
        [query(f"moewatch_rebalance_ledger_break_even_steps{{{GROUP_SEL}}}", "break-even {{policy}} {{model}}/{{ep_group}}",
               "A"),
         query(f"moewatch_rebalance_ledger_horizon_steps{{{GROUP_SEL}}}", "horizon {{policy}} {{model}}/{{ep_group}}",
               "B")], width=12).draw_style(common.GraphDrawStyle.POINTS)
    measured = series_panel(
        "Measured balancedness and step time around it", "Balancedness measured on the windows before and after "
        "the latest rebalance, and seconds per step before, during the move and after.", "s",
        [query(f"moewatch_rebalance_ledger_step_seconds{{{GROUP_SEL}}}", "step {{phase}} {{policy}}", "A"),
         query(f"moewatch_rebalance_ledger_balancedness_ratio{{{GROUP_SEL}}}", "balancedness {{phase}} {{policy}}",
               "B")], width=12).draw_style(common.GraphDrawStyle.POINTS)
    return [outcomes, net, stall_gain, even, measured]


def shard_panels() -> list[Any]:
    """A sharded group's windows (one shard per DP rank, merged by the agent, docs/deploy.md): whether
    every shard makes it, and whether the ranks agree on the engine's rebalances. Empty for groups that
    send whole windows."""
    windows = increase_bars(
        "Windows merged from shards", "Windows the agent merged from the group's shards, per interval: complete, "
        "or partial (merged at the deadline without the shards missing or refused; alert MoewatchShardsMissing).",
        "moewatch_shard_windows_total", "outcome", "{{outcome}}").stacking(
        common_b.StackingConfig().mode(common.StackingMode.NORMAL))
    lost = series_panel(
        "Shards missing and refused", "Shards not in by the deadline (missing), and shards left out by reason: "
        "late_shard (after their window left), a disagreement with the other shards (count, sizes, map, epoch), "
        "duplicate_shard, invalid_merge.", "short",
        [query(f"sum by (model, ep_group) (increase(moewatch_shards_missing_total{{{GROUP_SEL}}}[$__rate_interval]))",
               "missing {{model}}/{{ep_group}}", "A"),
         query(f"sum by (reason) (increase(moewatch_shards_refused_total{{{GROUP_SEL}}}[$__rate_interval]))",
               "{{reason}}", "B")], width=8).draw_style(common.GraphDrawStyle.BARS)
    disagree = increase_bars(
        "Ranks disagreeing on a rebalance", "Engine rebalance calls whose digest (inputs, settings, result) differed "
        "across the shards: ranks that may hold different maps (alert MoewatchEngineRanksDisagree; the audit log "
        "names the shards).", "moewatch_engine_rebalance_digest_mismatches_total", "model, ep_group",
        "{{model}}/{{ep_group}}")
    return [windows, lost, disagree]


def slo_panels() -> list[Any]:
    """The engine's own TTFT and per-token latency against the SLO targets, and whether the MoE
    evidence explains a breach (the agent's slo: section)."""
    ttft = series_panel(
        "TTFT p99 and its SLO", "The engine's time to first token, p99 over each scrape interval, from its own "
        "histogram; the dashed line is the target the agent judges by.", "s",
        [query(f'moewatch_slo_latency_seconds{{{GROUP_SEL}, signal="ttft", percentile="p99"}}',
               "p99 {{model}}/{{ep_group}}", "A"),
         query(f'moewatch_slo_target_seconds{{{GROUP_SEL}, slo="ttft_p99"}}', "target {{model}}/{{ep_group}}", "B")],
        width=8)
    per_token = series_panel(
        "Inter-token latency and TPOT p99", "The engine's inter-token latency and time per output token, p99 over "
        "each scrape interval, against the TPOT target.", "s",
        [query(f'moewatch_slo_latency_seconds{{{GROUP_SEL}, signal=~"itl|tpot", percentile="p99"}}',
               "{{signal}} p99 {{model}}/{{ep_group}}", "A"),
         query(f'moewatch_slo_target_seconds{{{GROUP_SEL}, slo="tpot_p99"}}', "target {{model}}/{{ep_group}}", "B")],
        width=8)
    share = series_panel(
        "MoE share of the inter-token latency", "While an SLO is breached: the unhealthy MoE layers' seconds at "
        "stake per step over the inter-token latency p99 (at or over slo.explain_share, 20% by default, the MoE "
        "evidence explains the breach).", "percentunit",
        [query(f"moewatch_slo_moe_share_ratio{{{GROUP_SEL}}}", "{{model}}/{{ep_group}}", "A"),
         query(f"moewatch_slo_breached{{{GROUP_SEL}}}", "breached {{slo}} {{model}}/{{ep_group}}", "B")],
        width=8, limit=0.2)
    return [ttft, per_token, share]


def fleet_panels() -> list[Any]:
    """Many EP groups, one agent each, one Prometheus: groups and their worst layers ranked by the
    seconds at stake (the fleet rules at the end of alerts/moewatch_recording.yml), the worst first."""
    at_stake = ("Seconds a layer's best action would save per step, times the group's steps per second: "
                "the share of the group's serving time at stake.")
    groups = (bargauge.Panel().title("Groups by time at stake")
              .description(f"EP groups ranked by the time all their layers have at stake, top 20. {at_stake}")
              .datasource(DS).span(9).height(10).unit("percentunit").min(0)
              .with_target(query(f"sort_desc(topk(20, group:moewatch_seconds_at_stake:rate5m{{{GROUP_SEL}}}))",
                                 "{{model}}/{{ep_group}}", "A", instant=True))
              .display_mode(common.BarGaugeDisplayMode.GRADIENT)
              .orientation(common.VizOrientation.HORIZONTAL)
              .thresholds(thresholds((None, "green"), (0.05, "orange"), (0.2, "red"))))
    worst = (bargauge.Panel().title("Worst layer of each group")
             .description(f"Each group's layer with the most at stake, groups ranked by it: the first bar is the "
                          f"worst layer of the worst group. {at_stake}")
             .datasource(DS).span(9).height(10).unit("percentunit").min(0)
             .with_target(query(f"sort_desc(topk(20, group:moewatch_worst_layer_seconds_at_stake:rate5m"
                                f"{{{GROUP_SEL}}}))", "{{model}}/{{ep_group}} layer {{layer}}", "A", instant=True))
             .display_mode(common.BarGaugeDisplayMode.GRADIENT)
             .orientation(common.VizOrientation.HORIZONTAL)
             .thresholds(thresholds((None, "green"), (0.05, "orange"), (0.2, "red")))
             .data_links([dash_b.DashboardLink("Open ${__field.labels.ep_group} layer ${__field.labels.layer}")
                          .type(dash_m.DashboardLinkType.LINK).url(
                              "/d/moewatch-layer?var-datasource=${datasource}&var-model=${__field.labels.model}"
                              "&var-ep_group=${__field.labels.ep_group}&var-layer=${__field.labels.layer}"
                              "&${__url_time_range}")]))
    fleet_stake = (stat.Panel().title("Fleet time at stake")
                   .description(f"Summed over every group (not filtered). {at_stake}")
                   .unit("percentunit").datasource(DS).span(6).height(5)
                   .with_target(query("fleet:moewatch_seconds_at_stake:rate5m", "", "A"))
                   .thresholds(thresholds((None, "green"), (0.05, "orange")))
                   .color_mode(common.BigValueColorMode.VALUE).graph_mode(common.BigValueGraphMode.AREA))
    fleet_unhealthy = (stat.Panel().title("Groups with an unhealthy layer")
                       .description("EP groups (all of them, not filtered) with at least one layer not healthy.")
                       .unit("short").datasource(DS).span(6).height(5)
                       .with_target(query("fleet:moewatch_groups_unhealthy:count", "", "A"))
                       .thresholds(thresholds((None, "green"), (1, "orange")))
                       .color_mode(common.BigValueColorMode.VALUE).graph_mode(common.BigValueGraphMode.AREA))
    cross_node = series_panel(
        "Cross-node share per layer", "Share of pairs computed on another node, over the slower inter-node "
        "(RDMA) link, for groups that span nodes; 0 on one node.", "percentunit",
        [query(f"layer:moewatch_layer_cross_node_ratio:max{{{GROUP_SEL}}}", "{{ep_group}} layer {{layer}}", "A")],
        width=24)
    return [worst, groups, fleet_stake, fleet_unhealthy, cross_node]


def layer() -> dash_b.Dashboard:
    verdict = (statetimeline.Panel().title("Verdict").description("This layer's triage verdict over time.")
               .datasource(DS).span(16).height(4).mappings(VERDICT_MAPPINGS)
               .with_target(query(f"layer:moewatch_layer_verdict:code{{{LAYER_SEL}}}", "layer {{layer}}", "A"))
               .show_value(common.VisibilityMode.AUTO).merge_values(True).fill_opacity(80))
    unhealthy = stat_panel("Unhealthy windows", "Consecutive windows with a verdict other than healthy.",
                           "short", query(f"max(moewatch_layer_unhealthy_windows{{{LAYER_SEL}}})", "", "A"),
                           width=8, steps=((None, "green"), (1, "orange")))
    times = series_panel(
        "All-to-all against expert compute",
        "Per step, each the slowest rank's: dispatch + combine all-to-all, expert compute, the whole layer.",
        "s",
        [query(f"layer:moewatch_layer_a2a_seconds:sum{{{LAYER_SEL}}}", "all-to-all (dispatch + combine)", "A"),
         query(f"max(moewatch_layer_compute_seconds{{{LAYER_SEL}}})", "expert compute", "B"),
         query(f"max(moewatch_layer_seconds{{{LAYER_SEL}}})", "whole layer", "C")])
    share = series_panel(
        "All-to-all share of layer time: transfer and waiting",
        f"Triage step 1 uses the transfer: at or above {T.comm_share:g} communication dominates ([a2a-bottleneck]). "
        "Waiting for a later rank is a straggler's cost (step 2), not communication.", "percentunit",
        [query(f"max(moewatch_layer_a2a_share_ratio{{{LAYER_SEL}}})", "all-to-all share", "A"),
         query(f"max(moewatch_layer_a2a_transfer_share_ratio{{{LAYER_SEL}}})", "transfer", "B"),
         query(f"max(moewatch_layer_a2a_wait_share_ratio{{{LAYER_SEL}}})", "waiting for a later rank", "C")],
        limit=T.comm_share).min(0).max(1)
    a2a_p = series_panel(
        "All-to-all per step, p50 and p99 (5m)",
        f"Over windows (each window's per-step mean); [serving-2026]: p99 under {T.a2a_p99_seconds * 1e3:g} ms.", "s",
        [query(f"layer:moewatch_layer_a2a_step_seconds:p50_5m{{{LAYER_SEL}}}", "p50", "A"),
         query(f"layer:moewatch_layer_a2a_step_seconds:p99_5m{{{LAYER_SEL}}}", "p99", "B")],
        limit=T.a2a_p99_seconds)
    rank_load = series_panel(
        "Rank load", "Pairs each rank computed per step (local + received).", "short",
        [query(f"max by (rank) (moewatch_rank_load_pairs{{{LAYER_SEL}}})", "rank {{rank}}", "A")])
    dispersion = series_panel(
        "Rank load dispersion",
        f"Triage step 2: std/mean above {T.rank_load_cv:g} ([serving-2026]) or max/mean above "
        f"{T.rank_load_max_mean:g} means the ranks are imbalanced.", "short",
        [query(f"max(moewatch_layer_rank_load_cv_ratio{{{LAYER_SEL}}})", "std/mean", "A"),
         query(f"max(moewatch_layer_rank_load_max_mean_ratio{{{LAYER_SEL}}})", "max/mean", "B"),
         query(f"max(moewatch_layer_expert_load_cv_ratio{{{LAYER_SEL}}})", "expert std/mean", "C")],
        limit=T.rank_load_cv).min(0)
    speed = series_panel(
        "Rank speed and balance by time",
        f"Each rank's pairs per compute second over the median rank's (the agent counts a rank slow under "
        f"policy.slow_rank_below, 0.85 by default), and the layer's mean over max of per-rank expert time: a plan "
        f"made for a slow rank lowers plain balancedness and raises this.", "percentunit",
        [query(f"max by (rank) (moewatch_rank_relative_speed{{{GROUP_SEL}}})", "rank {{rank}} speed", "A"),
         query(f"max(moewatch_layer_time_balancedness_ratio{{{LAYER_SEL}}})", "time balancedness", "B")],
        limit=0.85).min(0)
    expert_heat = (heatmap.Panel().title("Expert load share")
                   .description("How many experts carry each multiple of the layer's mean expert load, per "
                                "interval: mass above 2x is hot experts, below 0.5x cold ones.")
                   .datasource(DS).span(24).height(10)
                   .with_target(query(f"sum by (le) (increase(moewatch_layer_expert_load_share_bucket"
                                      f"{{{LAYER_SEL}}}[$__rate_interval]))", "{{le}}", "A",
                                      fmt=PromQueryFormat.HEATMAP))
                   .calculate(False)
                   .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.LE).value("experts"))
                   .y_axis(heatmap.YAxisConfig().unit("suffix:x").decimals(2))
                   .color(heatmap.HeatmapColorOptions().mode("scheme").scheme("Oranges").fill("dark-orange")
                          .scale("exponential").exponent(0.5).steps(64).reverse(False))
                   .cell_gap(1).show_legend().show_y_histogram())
    cross = series_panel(
        "Cross-rank ratio against the placement's prediction",
        f"Triage step 3: more than {T.cross_rank_margin:g} above the prediction means the expert-to-rank "
        "mapping drives the traffic.", "percentunit",
        [query(f"max(moewatch_layer_cross_rank_ratio{{{LAYER_SEL}}})", "measured", "A"),
         query(f"max(moewatch_layer_expected_cross_rank_ratio{{{LAYER_SEL}}})", "placement's prediction", "B"),
         query(f"layer:moewatch_layer_cross_rank_excess:ratio{{{LAYER_SEL}}}", "excess", "C")],
        width=24).min(0)
    aurora = series_panel(
        "Aurora efficiency and balancedness",
        "Aurora: the all-to-all lower bound over the measured time (1 = at the bound). Balancedness: mean "
        "over max of per-rank load (1 = balanced; the vLLM/SGLang convention).", "percentunit",
        [query(f"max(moewatch_layer_a2a_efficiency_ratio{{{LAYER_SEL}}})", "Aurora efficiency", "A"),
         query(f"max(moewatch_layer_balancedness_ratio{{{LAYER_SEL}}})", "balancedness", "B")]).min(0).max(1)
    capacity = series_panel(
        "Capacity factor",
        f"In force (0 = dropless) and effective (computed pairs over granted capacity; [serving-2026]: above "
        f"{T.effective_capacity_factor:g}).", "short",
        [query(f"max(moewatch_layer_capacity_factor{{{LAYER_SEL}}})", "capacity factor", "A"),
         query(f"max(moewatch_layer_effective_capacity_factor{{{LAYER_SEL}}})", "effective", "B")],
        limit=T.effective_capacity_factor).min(0)
    overflow = series_panel(
        "Overflow",
        f"Share of routed pairs dropped or rerouted by capacity; [serving-2026]: under {T.overflow_rate:.0%}.",
        "percentunit",
        [query(f"layer:moewatch_layer_overflow_pairs:ratio_rate5m{{{LAYER_SEL}}}", "overflow (5m)", "A"),
         query(f"max(moewatch_layer_overflow_ratio{{{LAYER_SEL}}})", "overflow (latest window)", "B")],
        limit=T.overflow_rate).min(0)
    drops = series_panel(
        "Dropped and rerouted pairs per second", "[serving-2026]: dropped tokens ideally 0.", "short",
        [query(f"sum(rate(moewatch_layer_dropped_pairs_total{{{LAYER_SEL}}}[$__rate_interval]))", "dropped", "A"),
         query(f"sum(rate(moewatch_layer_rerouted_pairs_total{{{LAYER_SEL}}}[$__rate_interval]))", "rerouted", "B")])
    board = base("moewatch-layer", "moewatch / layer",
                 "One MoE layer in the order of the triage: all-to-all share, rank and expert load, "
                 "cross-rank traffic, then capacity.")
    return with_panels(board.variables(variables(with_layer=True)), [
        ("Verdict", [verdict, unhealthy]),
        ("1. All-to-all", [times, share, a2a_p, aurora]),
        ("2. Load", [rank_load, dispersion, speed, expert_heat]),
        ("3. Traffic", [cross]),
        ("Capacity", [capacity, overflow, drops]),
    ])


def agent_health() -> dash_b.Dashboard:
    inst = 'instance=~"$instance"'
    mode = (stat.Panel().title("Mode").description("observe, recommend or act.").datasource(DS).span(6).height(4)
            .with_target(query(f"moewatch_agent_mode{{{inst}}} == 1", "{{mode}}", "A", instant=True))
            .text_mode(common.BigValueTextMode.NAME).color_mode(common.BigValueColorMode.NONE)
            .graph_mode(common.BigValueGraphMode.NONE))
    version = (stat.Panel().title("Version").description("The agent's version.").datasource(DS).span(6).height(4)
               .with_target(query(f"moewatch_agent_info{{{inst}}}", "{{version}}", "A", instant=True))
               .text_mode(common.BigValueTextMode.NAME).color_mode(common.BigValueColorMode.NONE)
               .graph_mode(common.BigValueGraphMode.NONE))
    up = stat_panel("Scrape up", "1 while Prometheus scrapes the agent (MoewatchAgentDown fires on 0).", "none",
                    query(f"min(up{{{inst}}})", "", "A"), width=6, steps=((None, "red"), (1, "green")))
    connected = (statetimeline.Panel().title("Runtime connected")
                 .description("1 while a runtime of the EP group is connected to the socket.")
                 .datasource(DS).span(6).height(4)
                 .with_target(query(f"max by (model, ep_group) (moewatch_runtime_connected{{{inst}}})",
                                    "{{model}}/{{ep_group}}", "A"))
                 .mappings([dash_m.ValueMap(options={
                     "0": dash_m.ValueMappingResult(text="disconnected", color="red", index=0),
                     "1": dash_m.ValueMappingResult(text="connected", color="green", index=1)})])
                 .show_value(common.VisibilityMode.NEVER).merge_values(True))
    received = series_panel(
        "Frames received per second", "By frame type (hello, window, ack, heartbeat).", "short",
        [query(f"sum by (type) (rate(moewatch_frames_received_total{{{inst}}}[$__rate_interval]))", "{{type}}", "A")])
    rejected = series_panel(
        "Frames rejected per second", "By reason (malformed, oversized, out_of_order, stale_epoch, "
        "invalid_window...): a rejected window is never half-applied.", "short",
        [query(f"sum by (reason) (rate(moewatch_frames_rejected_total{{{inst}}}[$__rate_interval]))",
               "{{reason}}", "A")])
    dropped = series_panel(
        "Frames the runtime dropped per second", "The probe drops frames rather than block a step when the "
        "agent is absent or slow.", "short",
        [query(f"sum by (model, ep_group) (rate(moewatch_runtime_frames_dropped_total{{{inst}}}[$__rate_interval]))",
               "{{model}}/{{ep_group}}", "A")])
    windows = series_panel(
        "Windows accepted per second", "Windows that passed validation, per EP group.", "short",
        [query(f"sum by (model, ep_group) (rate(moewatch_windows_total{{{inst}}}[$__rate_interval]))",
               "{{model}}/{{ep_group}}", "A")])
    age = series_panel(
        "Age of the newest window", "MoewatchTelemetryStale fires above 5 minutes.", "s",
        [query("group:moewatch_last_window:age_seconds", "{{model}}/{{ep_group}}", "A")], limit=300).min(0)
    # The catalogue labels these counters `job` (the scheduled job); Prometheus keeps its own target
    # label `job` and renames the exported one to `task` (honor_labels: false, the default).
    jobs = series_panel(
        "Job errors and misfires", "Scheduled job runs that raised or were missed (never fatal).", "short",
        [query(f"sum by (task) (increase(moewatch_job_errors_total{{{inst}}}[$__rate_interval]))",
               "{{task}} errors", "A"),
         query(f"sum by (task) (increase(moewatch_job_misfires_total{{{inst}}}[$__rate_interval]))",
               "{{task}} misfires", "B")])
    expert_cap = series_panel(
        "Per-expert series left out", "Per-expert series the cap kept out of /metrics.", "short",
        [query(f"max by (model, ep_group) (moewatch_expert_series_dropped{{{inst}}})", "{{model}}/{{ep_group}}", "A")])
    board = base("moewatch-agent", "moewatch / agent health",
                 "The sidecar itself: is it scraped, what mode it is in, what it receives and rejects.")
    instance_var = (dash_b.QueryVariable("instance").label("Agent").datasource(DS)
                    .query("label_values(moewatch_agent_info, instance)")
                    .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
                    .sort(dash_m.VariableSort.ALPHABETICAL_ASC).include_all(True).multi(True))
    return with_panels(board.variables([variables(False)[0], instance_var]), [
        ("Agent", [up, mode, version, connected]),
        ("Ingest", [received, rejected, dropped, windows, age]),
        ("Jobs", [jobs, expert_cap]),
    ])


DASHBOARDS = {"overview.json": overview, "layer.json": layer, "agent.json": agent_health}


def render_all() -> dict[str, str]:
    """File name -> JSON text, exactly as committed."""
    return {name: json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"
            for name, build in DASHBOARDS.items()}


# --- checks -------------------------------------------------------------------------------------

_STRING = re.compile(r'"(?:\\.|[^"\\])*"' r"|'(?:\\.|[^'\\])*'" r"|`[^`]*`")
_CLAUSE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_TOKEN = re.compile(r"(?P<num>(?:0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?:ms|[smhdwy])*)"
                    r"|(?P<id>[a-zA-Z_:][a-zA-Z0-9_:]*)")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
             "group_right", "inf", "nan", "atan2", "start", "end"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)")


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (a small lexer, not a parser: promtool checks syntax).

    Strings, label matchers, ranges and grouping clauses are removed; what remains that is neither a
    number, a keyword nor a function call is a metric name."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)
    text = _CLAUSE.sub(" ", text)
    names = set()
    for m in _TOKEN.finditer(text):
        name = m.group("id")
        if name is None or name.lower() in _KEYWORDS:
            continue
        if re.match(r"\s*\(", text[m.end():]):
            continue  # a function call
        names.add(name)
    return names


def recording_rules(root: Path = ROOT) -> dict[str, str]:
    """Recorded name -> expression, over every rule file."""
    out = {}
    for path in sorted(root.glob(RULES_GLOB)):
        for group in (yaml.safe_load(path.read_text()) or {}).get("groups", []):
            for rule in group.get("rules", []):
                if "record" in rule:
                    out[rule["record"]] = rule["expr"]
    return out


def known_metrics(root: Path = ROOT) -> set[str]:
    return catalog.exposed_names() | set(recording_rules(root)) | PROMETHEUS_SERIES


def _panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels or []:
        yield panel
        yield from _panels(panel.get("panels", []))


def dashboard_queries(board: dict) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable of one dashboard's JSON."""
    title = board.get("title", "?")
    for panel in _panels(board.get("panels", [])):
        for target in panel.get("targets", []):
            yield f"{title} / {panel.get('title')} / {target.get('refId')}", target.get("expr", "")
    for var in board.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var.get("query")
            q = q.get("query", "") if isinstance(q, dict) else q
            m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", q, re.S)
            yield f"{title} / variable {var['name']}", (m.group(1) if m else q)


def substitute(expr: str, names: set[str]) -> tuple[str, set[str]]:
    """Replace Grafana variables with values PromQL accepts; return the unknown variables too."""
    unknown = set()

    def value(m: re.Match) -> str:
        name = next(g for g in m.groups() if g)
        if name in GRAFANA_BUILTINS:
            return GRAFANA_BUILTINS[name]
        if name not in names:
            unknown.add(name)
        return "0"

    return _VARIABLE.sub(value, expr), unknown


def check_boards(boards: dict[str, dict], root: Path = ROOT) -> list[str]:
    """Problems in the queries of the given dashboards (file name -> JSON), or []."""
    problems, exprs = [], []
    known = known_metrics(root)
    for fname, board in boards.items():
        variables_ = {v["name"] for v in board.get("templating", {}).get("list", [])}
        for panel in _panels(board.get("panels", [])):
            refs = [t.get("refId") for t in panel.get("targets", [])]
            if any(not r for r in refs) or len(set(refs)) != len(refs):
                problems.append(f"{fname}: {panel.get('title')}: every query needs its own refId, got {refs}")
        for where, expr in dashboard_queries(board):
            if not expr.strip():
                problems.append(f"{fname}: {where}: empty query")
                continue
            parsed, unknown_vars = substitute(expr, variables_)
            for var in sorted(unknown_vars):
                problems.append(f"{fname}: {where}: ${var} is not a variable of this dashboard")
            for name in sorted(metric_names(parsed) - known):
                problems.append(f"{fname}: {where}: {name} is neither exported by the agent "
                                f"(agent/catalog.py) nor recorded in {RULES_GLOB}")
            exprs.append((f"{fname}: {where}", parsed))
    problems += promtool_parse(exprs)
    return problems


def promtool_parse(exprs: list[tuple[str, str]]) -> list[str]:
    """Parse every expression with `promtool check rules` (one recording rule each)."""
    if not exprs:
        return []
    promtool = shutil.which("promtool")
    if promtool is None:
        return ["promtool not found: install Prometheus's promtool (Debian: apt-get install prometheus)"]
    rules = {"groups": [{"name": "dashboard-queries",
                         "rules": [{"record": f"dashboard:query_{i}", "expr": e} for i, (_, e) in enumerate(exprs)]}]}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dashboard_queries.yml"
        path.write_text(yaml.safe_dump(rules, sort_keys=False))
        proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    if proc.returncode == 0:
        return []
    out = proc.stdout + proc.stderr
    problems = []
    for m in re.finditer(r'"dashboard:query_(\d+)": (.*)', out):
        where, expr = exprs[int(m.group(1))]
        problems.append(f"{where}: does not parse ({m.group(2).strip()}): {expr}")
    return problems or [f"promtool check rules failed: {out.strip()}"]


def check(json_dir: Path = JSON_DIR) -> list[str]:
    expected = render_all()
    problems = []
    committed = {p.name for p in json_dir.glob("*.json")} if json_dir.is_dir() else set()
    for name in sorted(set(expected) | committed):
        path = json_dir / name
        if name not in expected:
            problems.append(f"{path}: not written by this generator (remove it or add it to DASHBOARDS)")
        elif name not in committed:
            problems.append(f"{path}: missing; run python dashboards/generate.py")
        elif path.read_text() != expected[name]:
            problems.append(f"{path}: differs from what the generator writes; run python dashboards/generate.py")
    problems += check_boards({name: json.loads(text) for name, text in expected.items()})
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="check instead of writing; exit 1 on any problem")
    parser.add_argument("--out", type=Path, default=JSON_DIR, help="folder of the dashboards' JSON")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.out)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            return 1
        print(f"{len(DASHBOARDS)} dashboards match the generator; every query parses and names known metrics")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in render_all().items():
        (args.out / name).write_text(text)
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
