"""Windows carrying the engine rebalance records of moewatch's EPLB policy (extra.engine_rebalance):
exported as moewatch_engine_rebalance_* and written to the audit log as engine_rebalance; records
that are not well formed are left out."""

from __future__ import annotations

import json
import time

import numpy as np

from moewatch.agent.metrics.state import MetricsState
from moewatch.agent.metrics.windows import GroupExportMemory, record_window
from moewatch.planner.placement_math import contiguous_placement
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


def test_every_outcome_the_planner_names_is_counted_under_its_own_label(helpers):
    from moewatch.planner.rebalance import OUTCOMES as DECISION_OUTCOMES

    outcomes = {name: i + 1 for i, name in enumerate(DECISION_OUTCOMES.values())}
    state = MetricsState()
    w = window_with(helpers, [{"engine": "sglang", "layer_outcomes": outcomes}])
    record_window(state, GroupExportMemory(), w, diagnose(w), expert_metrics=False)
    for name, count in outcomes.items():
        assert state.get("moewatch_engine_rebalance_layers_total", (*GROUP, name)) == count, name
    assert "moved_less" in outcomes


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


def test_a_rebalance_is_checked_on_the_next_window_and_a_worse_layer_reported():
    from moewatch.agent import engine_rebalance as er

    record = {"engine": "vllm", "layers_by_reason": {"moved": [0, 2], "kept: no load": [1]}}
    fallback = {"engine": "vllm", "fallback": True, "layers_by_reason": {"moved": [1]}}
    assert er.moved_layers([record, fallback, {"layers_by_reason": {"moved": ["x", True]}}]) == (0, 2)
    before = np.array([0.90, 0.50, 0.80])
    pending, verdict = er.step(None, before, np.array([0.9, 0.5, 0.8]), [record], drop=0.05)
    assert verdict is None and pending.before == {0: 0.90, 2: 0.80}
    # unmeasured next window: still pending
    assert er.step(pending, None, None, [], 0.05) == (pending, None)
    pending, verdict = er.step(pending, np.array([0.9, 0.5, 0.8]), np.array([0.95, 0.1, 0.70]), [], drop=0.05)
    assert pending is None
    assert verdict["verdict"] == "worse" and verdict["layers_checked"] == [0, 2] and verdict["layers_worse"] == [2]
    _, fine = er.step(er.PendingCheck({0: 0.9}), None, np.array([0.88]), [], drop=0.05)
    assert fine["verdict"] == "not_worse" and fine["layers_worse"] == []
    # no window before the rebalance: nothing to compare with
    assert er.step(None, None, before, [record], 0.05) == (None, None)


def test_the_agent_reports_a_rebalance_that_made_a_layer_worse(helpers, start_agent, short_tmp):
    daemon = start_agent()
    pmap = helpers.contiguous(L, E, P)
    even = helpers.make_window(np.full((L, E), 100, dtype=np.int64), pmap, W, start_time=1000.0)
    moved = {"engine": "vllm", "fallback": False, "layer_outcomes": {"moved": 1, "kept_idle": 1},
             "layers_by_reason": {"moved": [0]}, "experts_moved": 4}
    skewed = helpers.hot_load(L, E, hot=0)
    windows = [even, helpers.make_window(np.full((L, E), 100, dtype=np.int64), pmap, W, start_time=1010.0),
               helpers.make_window(skewed, pmap, W, start_time=1020.0)]
    windows[1] = windows[1].replace(extra={**windows[1].extra, "engine_rebalance": [moved]})
    for w in windows:
        assert daemon.ingest_window(w) is None
    deadline = time.monotonic() + 10
    verdicts = []
    while time.monotonic() < deadline and not verdicts:
        daemon.audit.sync()
        verdicts = [json.loads(x) for x in (short_tmp / "audit.jsonl").read_text().splitlines()
                    if '"engine_rebalance_verdict"' in x]
        time.sleep(0.05)
    assert len(verdicts) == 1 and verdicts[0]["verdict"] == "worse" and verdicts[0]["layers_worse"] == [0]
    assert daemon.metrics.get("moewatch_engine_rebalance_verdicts_total", (*GROUP, "worse")) == 1
    assert daemon.metrics.get("moewatch_engine_rebalance_layers_worse_total", GROUP) == 1
    # what an operator reads in /status and `moewatch top`
    from moewatch.agent.top import fetch_status, render

    status = fetch_status(daemon.http_url)
    seen = status["groups"][0]["engine_rebalance"]
    assert seen["calls"] == 1 and seen["fallbacks"] == 0 and seen["checks"] == 1 and seen["worse"] == 1
    assert seen["last"]["experts_moved"] == 4 and seen["last"]["window_end"] == windows[1].end_time
    assert seen["last_check"] == {"window_end": windows[2].end_time, "verdict": "worse", "layers_worse": [0]}
    text = render(status, colour=False)
    assert "engine rebalance (vllm, moewatch's policy): 1 call, 0 answered" in text
    assert "1 so far, 1 worse" in text and "WORSE on layers 0" in text


def test_the_status_of_engine_rebalances_follows_the_records_and_checks():
    from moewatch.agent import engine_rebalance as er

    assert er.status_after(None, [], None, 10.0) is None
    decided = {"engine": "sglang", "layers_moved": 3, "layers_kept": 2, "experts_moved": 40,
               "layer_outcomes": {"moved": 3, "kept_not_paying": 2, "bad": "x"}, "balancedness_before": 0.8,
               "balancedness_after": 0.99, "predicted_stall_seconds": float("nan"), "solve_seconds": 0.02}
    first = er.status_after(None, [decided], None, 10.0)
    assert first["calls"] == 1 and first["engine"] == "sglang" and first["fallbacks"] == 0
    assert first["last"]["layer_outcomes"] == {"moved": 3, "kept_not_paying": 2}
    assert first["last"]["predicted_stall_seconds"] is None  # not a finite number: not shown as one
    assert first["last"]["balancedness_after"] == 0.99 and first["last"]["window_end"] == 10.0
    failed = {"engine": "sglang", "fallback": True, "error": "RuntimeError: injected"}
    second = er.status_after(first, [failed], {"verdict": "not_worse", "layers_worse": []}, 20.0)
    assert first["calls"] == 1 and "last_check" not in first  # the earlier one is left as it was
    assert second["calls"] == 2 and second["fallbacks"] == 1 and second["last"] == first["last"]
    assert second["last_fallback"] == {"window_end": 20.0, "error": "RuntimeError: injected"}
    assert second["checks"] == 1 and second["worse"] == 0 and second["last_check"]["verdict"] == "not_worse"
    assert er.status_after(second, [], None, 30.0) is second  # a window without either changes nothing


def test_top_shows_the_latest_engine_rebalance_and_its_check():
    from moewatch.agent.top import format_engine_rebalance

    status = {"engine": "vllm", "calls": 4, "fallbacks": 1, "checks": 3, "worse": 1,
              "last": {"window_end": 0.0, "layers_moved": 40.0, "layers_kept": 21.0,
                       "layer_outcomes": {"moved": 40, "kept_no_better": 18, "kept_not_paying": 3},
                       "experts_moved": 4512.0, "balancedness_before": 0.912, "balancedness_after": 0.994,
                       "predicted_stall_seconds": 1.2, "solve_seconds": 0.019},
              "last_check": {"window_end": 0.0, "verdict": "worse", "layers_worse": [3, 7]},
              "last_fallback": {"window_end": 0.0, "error": "RuntimeError: injected"}}
    head, check, failed = format_engine_rebalance(status, colour=False)
    assert head.startswith("engine rebalance (vllm, moewatch's policy): 4 calls, 1 answered by the engine's own")
    assert ("40 layers moved, 21 kept (kept_no_better 18, kept_not_paying 3), 4512 slots, balancedness "
            "0.912 -> 0.994 predicted, stall 1.20 s, call 19.0 ms") in head
    assert check.endswith("WORSE on layers 3, 7") and "(3 so far, 1 worse)" in check
    assert failed.endswith("RuntimeError: injected")
    assert "\x1b[" in format_engine_rebalance(status, colour=True)[1]  # worse stands out in a terminal
    assert format_engine_rebalance(None, colour=False) == []


def test_the_engines_own_policys_calls_are_counted_checked_and_shown(helpers):
    """With moewatch's policy off the adapters record the engine's own calls (observed_rebalance: policy
    "engine", layers_changed, slots_moved): counted as result engine_own with their slots, their layers
    checked on the next window like moewatch's, and named as the engine's own in top."""
    from moewatch.agent import engine_rebalance as er
    from moewatch.agent.top import format_engine_rebalance
    from moewatch.engine_rebalancing import observed_rebalance

    load = helpers.hot_load(L, E, hot=0)
    before = contiguous_placement(L, E, P)
    after = before.copy()
    after[1, 11] = 0  # a replica of the hot expert on the last rank, in place of the one there
    own = {"engine": "vllm", "policy": "engine", "call": 3, "digest": "d",
           **observed_rebalance(load, before, after, W, expert_bytes=10.0)}
    assert own["layers_changed"] == [1] and own["slots_moved"] >= 1
    state = MetricsState()
    w = window_with(helpers, [own])
    record_window(state, GroupExportMemory(), w, diagnose(w), expert_metrics=False)
    assert state.get("moewatch_engine_rebalance_calls_total", (*GROUP, "vllm", "engine_own")) == 1
    assert state.get("moewatch_engine_rebalance_calls_total", (*GROUP, "vllm", "decided")) is None
    assert state.get("moewatch_engine_rebalance_experts_moved_total", GROUP) == own["slots_moved"]
    assert state.get("moewatch_engine_rebalance_balancedness_ratio", (*GROUP, "after")) == own["balancedness_after"]
    assert er.moved_layers([own]) == (1,)
    status = er.status_after(None, [own], None, 10.0)
    assert status["engine_own"] == 1 and status["last"]["policy"] == "engine_own"
    head, = format_engine_rebalance(status, colour=False)
    assert head.startswith("engine rebalance (vllm, its own policy): 1 call")
    assert f"by its own policy: 1 layers changed, {own['slots_moved']} slots" in head
