"""`moewatch demo --seconds N --json` (contract): only the summary object, with the promised keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moewatch.agent.audit import read_audit


@pytest.mark.slow
def test_demo_json_summary(short_tmp):
    proc = subprocess.run([sys.executable, "-m", "moewatch.cli", "demo", "--seconds", "12", "--json",
                           "--keep", str(short_tmp / "demo")], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)  # the whole of stdout is the object
    for key in ("tokens_lost", "actions_applied", "balancedness_before", "balancedness_after", "step_p99_before_s",
                "step_p99_after_s", "windows_seen", "pairs_lost", "agent_cpu_share", "agent_rss_bytes", "audit_log",
                "metrics_url"):
        assert key in summary, key
    assert summary["ranks"] == 4
    assert summary["tokens_lost"] == 0 and summary["pairs_lost"] == 0
    assert summary["windows_seen"] >= 5
    assert summary["actions_applied"] >= 1
    assert summary["balancedness_after"] > summary["balancedness_before"]
    assert 0 < summary["agent_cpu_share"] < 1 and summary["agent_rss_bytes"] > 0
    events = [r["event"] for r in read_audit(summary["audit_log"])]
    assert "plan_applied" in events
    assert Path(summary["folder"], "summary.json").exists()


def test_demo_bad_input_exits_2():
    proc = subprocess.run([sys.executable, "-m", "moewatch.cli", "demo", "--seconds", "1"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--seconds" in proc.stderr
