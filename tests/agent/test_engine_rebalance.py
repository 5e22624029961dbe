"""Windows carrying the engine rebalance records of moewatch's EPLB policy (extra.engine_rebalance):
exported as moewatch_engine_rebalance_* and written to the audit log as engine_rebalance; records
that are not well formed are left out."""

from __future__ import annotations

import json
import time

import numpy as np

from moewatch.agent.exporters import GroupExportMemory, MetricsState, record_window
from moewatch.planner.metrics import contiguous_placement
from moewatch.planner.rebalance import RebalanceSettings, gated_rebalance
from moewatch.triage import diagnose

W, L, E, P = 4, 2, 8, 12
GROUP = ("m", "g")


def records(helpers):
    load = helpers.hot_load(L, E, hot=0)
    decision = gated_rebalance(load, P, W, 1, current=contiguous_placement(L, E, P),
                               settings=RebalanceSettings(expert_bytes=1.0))
    return decision, [{"engine": "vllm", **decision.record()},
                      {"engine": "vllm", "fallback": True, "error": "RuntimeError: injected"},
                      {"engine": "vllm"}, "not a record"]


def window_with(helpers, carried):
    load, pmap = helpers.hot_load(L, E, hot=0), helpers.contiguous(L, E, P)
    w = helpers.make_window(load, pmap, W)
    return w.replace(extra={**w.extra, "engine_rebalance": carried})


def test_records_are_counted_and_the_latest_predictions_exported(helpers):
    decision, carried = records(helpers)
    state = MetricsState()
    w = window_with(helpers, carried)
    record_window(state, GroupExportMemory(), w, diagnose(w), expert_metrics=False)
    assert state.get("moewatch_engine_rebalance_calls_total", (*GROUP, "vllm", "decided")) == 1
    assert state.get("moewatch_engine_rebalance_calls_total", (*GROUP, "vllm", "fallback")) == 1
    assert state.get("moewatch_engine_rebalance_layers_total", (*GROUP, "moved")) == L
    assert state.get("moewatch_engine_rebalance_experts_moved_total", GROUP) == int(decision.experts_moved.sum()) > 0
    after = state.get("moewatch_engine_rebalance_balancedness_ratio", (*GROUP, "after"))
    before = state.get("moewatch_engine_rebalance_balancedness_ratio", (*GROUP, "before"))
    assert after == float(decision.balancedness_after.mean()) > before
    assert state.get("moewatch_engine_rebalance_solve_seconds", GROUP) == decision.solve_seconds


def test_the_agent_audits_each_engine_rebalance(helpers, start_agent, short_tmp):
    daemon = start_agent()
    decision, carried = records(helpers)
    assert daemon.ingest_window(window_with(helpers, carried)) is None
    deadline = time.monotonic() + 10
    lines = []
    while time.monotonic() < deadline:
        daemon.audit.sync()
        text = (short_tmp / "audit.jsonl").read_text()
        lines = [json.loads(x) for x in text.splitlines() if '"engine_rebalance"' in x]
        if len(lines) == 2:
            break
        time.sleep(0.05)
    assert [line["event"] for line in lines] == ["engine_rebalance"] * 2
    assert [line["decision"].get("fallback", False) for line in lines] == [False, True]
    assert lines[0]["model"] == "m" and lines[0]["ep_group"] == "g"
    assert lines[0]["decision"]["experts_moved"] == int(decision.experts_moved.sum())
    assert np.isclose(lines[0]["decision"]["balancedness_after"], float(decision.balancedness_after.mean()))
