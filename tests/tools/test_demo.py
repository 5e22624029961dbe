"""`moewatch demo --seconds N --json` (contract): only the summary object, with the promised keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from moewatch.agent.audit import read_audit
from moewatch.tools.demo import default_ranks
from moewatch.cli import main


@pytest.mark.slow
def test_demo_json_summary(short_tmp, monkeypatch):
    # The demo's own shape makes each step take a few hundred ms of expert compute (so the gain shows);
    # this checks the wiring and the summary on a small one, in this process (the runtime is still a
    # subprocess), so the test does not wait for big matmuls.
    from moewatch.tools import demo

    for key, value in {"hidden": 64, "ffn": 128, "batch-tokens": 128, "window-steps": 4}.items():
        monkeypatch.setitem(demo.DEMO_RUNTIME, key, value)
    results = short_tmp / "results"
    result = CliRunner().invoke(main, ["demo", "--seconds", "8", "--json", "--keep", str(short_tmp / "demo"),
                                       "--record", "--results-dir", str(results)])
    assert result.exit_code == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout)  # the whole of stdout is the object
    for key in ("tokens_lost", "actions_applied", "balancedness_before", "balancedness_after", "step_p99_before_s",
                "step_p99_after_s", "step_p50_before_s", "step_p50_after_s", "migration_stall_s", "windows_seen",
                "pairs_lost", "agent_cpu_share", "agent_rss_bytes", "audit_log", "metrics_url", "cpu_binding"):
        assert key in summary, key
    # One rank per core here (2 to 4), each pinned to its own: the busiest rank sets the step.
    assert summary["ranks"] == default_ranks(0) and summary["backend"] == "gloo"
    assert summary["cpu_binding"]["pinned"] == (len(os.sched_getaffinity(0)) >= summary["ranks"])
    stall = summary["migration_stall_s"]
    assert len(stall["per_plan"]) == summary["plans_applied"] + summary["rollbacks"] >= 1
    assert stall["total"] == pytest.approx(sum(stall["per_plan"]))
    assert summary["tokens_lost"] == 0 and summary["pairs_lost"] == 0
    assert summary["windows_seen"] >= 5
    assert summary["actions_applied"] >= 1
    assert summary["balancedness_after"] > summary["balancedness_before"]
    assert 0 < summary["agent_cpu_share"] < 1 and summary["agent_rss_bytes"] > 0
    audit = list(read_audit(summary["audit_log"]))
    events = [r["event"] for r in audit]
    assert "plan_applied" in events
    # The rebalance ledger's settled entries, as the agent audited them: the agent's plans, measured.
    settled = [r for r in audit if r["event"] == "rebalance_ledger"]
    assert summary["rebalances"] == [{k: r.get(k) for k in demo.LEDGER_KEYS} for r in settled]
    assert settled and all(r["policy"] in ("agent_plan", "agent_rollback") for r in settled)
    assert all(r["stall_seconds"] is not None and r["gain_seconds_per_step"] is not None for r in settled)
    assert Path(summary["folder"], "summary.json").exists()
    # --record: the summary with its provenance, which the README's rendered summary reads.
    record = json.loads(next(results.glob("demo-*.json")).read_text())
    assert record["bench"] == "demo" and record["result"] == summary and "busy" in record["provenance"]


def test_demo_bad_input_exits_2():
    proc = subprocess.run([sys.executable, "-m", "moewatch.cli", "demo", "--seconds", "1"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--seconds" in proc.stderr


def test_old_map_figures_leave_out_what_no_verified_layer_measured():
    # A short run on a busy machine can verify a plan whose layers carry no time on the old map: the
    # summary says n/a for it instead of a NaN that JSON refuses (a fresh-clone run failed so).
    from moewatch.tools.demo import old_map_figures

    events = [{"event": "verified", "numbers": {"0": {"balancedness_after": 0.9, "balancedness_old_map_same_load": 0.6,
                                                      "layer_seconds_after": None,
                                                      "layer_seconds_old_map_same_load": None}}}]
    figures = old_map_figures(events)
    assert figures == {"balancedness_after": 0.9, "balancedness_old_map_same_load": 0.6,
                       "layer_seconds_after": None, "layer_seconds_old_map_same_load": None}
    assert old_map_figures([]) is None
