"""The agent on windows with absent evidence: observed, triaged and exported with the missing evidence
marked; no series for what was not measured; the policy recommends from expert load without claiming
rank-level numbers, and never acts on a change it could not verify."""

from __future__ import annotations

import subprocess

import pytest

from moewatch.agent import policy
from moewatch.agent.config import AgentConfig
from moewatch.agent.metrics.state import MetricsState
from moewatch.agent.metrics.windows import GroupExportMemory, record_window
from moewatch.agent.params import from_config
from moewatch.agent.store import TriagedWindow
from moewatch.tools.examples import without_evidence
from moewatch.telemetry import EVIDENCE, OPTIONAL_ARRAYS
from moewatch.triage import diagnose

W, L, E, P = 4, 2, 8, 12
LAYER0 = ("m", "g", "0")


def logical_only(helpers, n=3, start=1000.0, epoch=0):
    """Windows of a hot expert as an engine that counts only logical routing sends them."""
    load, pmap = helpers.hot_load(L, E, hot=0), helpers.contiguous(L, E, P)
    return [without_evidence(helpers.make_window(load, pmap, W, start_time=start + 10 * i, epoch=epoch),
                             OPTIONAL_ARRAYS) for i in range(n)]


def test_exported_series_follow_the_evidence_window_by_window(helpers):
    state, memory = MetricsState(), GroupExportMemory()
    load, pmap = helpers.hot_load(L, E, hot=0), helpers.contiguous(L, E, P)
    full = helpers.make_window(load, pmap, W)
    bare = logical_only(helpers, 1, start=2000.0)[0]

    def record(w):
        record_window(state, memory, w, diagnose(w), expert_metrics=False)

    record(full)
    assert all(state.get("moewatch_layer_evidence_missing", (*LAYER0, kind)) == 0.0 for kind in EVIDENCE)
    assert state.get("moewatch_rank_load_pairs", (*LAYER0, "0")) is not None
    record(bare)
    assert all(state.get("moewatch_layer_evidence_missing", (*LAYER0, kind)) == (kind != "expert_load")
               for kind in EVIDENCE)
    # Nothing unmeasured keeps a series: the full window's rank-level and timing series are gone.
    for name in ("moewatch_layer_balancedness_ratio", "moewatch_layer_rank_load_max_min_ratio",
                 "moewatch_layer_a2a_share_ratio", "moewatch_layer_seconds", "moewatch_layer_cross_rank_ratio",
                 "moewatch_layer_overflow_ratio"):
        assert state.get(name, LAYER0) is None, name
    assert state.get("moewatch_rank_load_pairs", (*LAYER0, "0")) is None
    assert state.get("moewatch_rank_compute_seconds", ("m", "g", "0")) is None
    # What every window measures is still exported and counted.
    assert state.get("moewatch_layer_expert_load_cv_ratio", LAYER0) > 0.3
    assert state.get("moewatch_layer_routed_pairs_total", LAYER0) == 2 * int(full.expert_tokens[0].sum())
    assert state.get("moewatch_layer_dropped_pairs_total", LAYER0) == 0  # from the full window only
    assert state.get("moewatch_layer_verdict", (*LAYER0, "imbalance-bound", "hot-experts")) == 1.0
    assert state.get("moewatch_windows_total", ("m", "g")) == 2
    record(full.replace(start_time=3000.0, end_time=3001.0))
    assert state.get("moewatch_layer_evidence_missing", (*LAYER0, "rank_load")) == 0.0
    assert state.get("moewatch_layer_balancedness_ratio", LAYER0) is not None


def cfg(**sections):
    """The decision parameters of a config in recommend mode with K = 3, each keyword a section over it."""
    return from_config(AgentConfig.from_mapping({"policy": {"mode": "recommend", "persist_windows": 3}}, **sections))


def view(windows):
    return policy.GroupView(num_gpus=W, num_nodes=1, num_experts=E, num_slots=P,
                            capabilities=frozenset({"plan", "capacity"}), windows=windows)


@pytest.mark.parametrize("mode", ["recommend", "act"])
def test_policy_recommends_replication_from_expert_load_without_rank_numbers(helpers, mode):
    windows = [TriagedWindow(w, diagnose(w), 0.0) for w in logical_only(helpers)]
    proposal = policy.decide(view(windows), cfg(policy={"mode": mode}).policy, now=0.0)
    if mode == "act":
        assert not proposal.has_plan  # without rank load a live change could not be verified
    replicate = [d for d in proposal.decisions if d.kind == "replicate"]
    assert {d.layers for d in replicate} == {(0,), (1,)} and {d.result for d in replicate} == {"recommended"}
    for d in replicate:
        assert d.before["balancedness"] is None and d.before["layer_seconds_per_step"] is None
        assert d.after["model_balancedness"] > d.before["model_balancedness"]  # the planner's model, so named
        assert d.before["replicas"] == {0: 2} and d.after["replicas"][0] > 2  # contiguous: 12 slots, 8 experts
        if mode == "act":
            assert "not applied" in d.reason


@pytest.mark.slow
def test_live_agent_marks_missing_evidence_on_metrics(start_agent, helpers):
    daemon = start_agent(policy={"mode": "recommend", "persist_windows": 2}, jobs={"plan_interval_seconds": 0.2})
    rt = helpers.FakeRuntime(daemon.cfg.server.socket, world_size=W, num_layers=L, num_experts=E, num_slots=P).connect()
    group = helpers.wait_group(daemon)
    for w in logical_only(helpers, 3):
        rt.send(w)
    assert helpers.wait_for(lambda: len(group.history) == 3)
    assert helpers.wait_for(lambda: daemon.metrics.get("moewatch_actions_total",
                                                       ("m", "g", "replicate", "recommended"), 0) >= 1)
    text = helpers.scrape(daemon.http_url)
    for kind in EVIDENCE:  # a logical window lacks all but the expert load
        assert helpers.sample_value(text, "moewatch_layer_evidence_missing", layer="1",
                                    evidence=kind) == (kind != "expert_load")
    assert helpers.sample_value(text, "moewatch_layer_verdict", layer="1", verdict="imbalance-bound",
                                cause="hot-experts") == 1
    assert helpers.sample_value(text, "moewatch_layer_expert_load_cv_ratio", layer="1") > 0.3
    assert "moewatch_rank_load_pairs{" not in text and "moewatch_layer_balancedness_ratio{" not in text
    assert "moewatch_layer_a2a_step_seconds_count{" not in text
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    status = daemon.status()["groups"][0]
    assert status["layers"][0]["balancedness"] is None and status["layers"][0]["verdict"] == "imbalance-bound"
    assert status["summary"]["missing"] == [kind for kind in EVIDENCE if kind != "expert_load"]
    # `moewatch top` shows the unmeasured columns as `?`.
    from moewatch.agent.top import fetch_status, render

    rows = [line.split() for line in render(fetch_status(daemon.http_url), colour=False).splitlines()
            if line.strip().startswith(("0 ", "1 "))]
    assert len(rows) == 2 and all(row[1:7] == ["imbalance-bound", "hot-experts", "?", "?", "?", "?"] for row in rows)
    assert daemon.metrics.get("moewatch_job_errors_total", ("triage",)) == 0
    assert daemon.metrics.get("moewatch_job_errors_total", ("plan",)) == 0
