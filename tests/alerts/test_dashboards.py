"""dashboards/generate.py: the committed JSON is what it writes, its --check passes, and the check
fails on stale JSON, on an unknown metric and on a query that does not parse."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "dashboards" / "generate.py"


def load_generator():
    """dashboards/generate.py is a script, not a package: load it by path."""
    spec = importlib.util.spec_from_file_location("moewatch_dashboards_generate", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = load_generator()


def run(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)


def copy_tree(tmp_path: Path) -> Path:
    """The generator, its JSON and the rule files it checks against, in a scratch repository."""
    shutil.copytree(ROOT / "dashboards", tmp_path / "dashboards", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "alerts", tmp_path / "alerts")
    return tmp_path / "dashboards" / "generate.py"


def test_check_passes_on_the_committed_dashboards():
    proc = run(GENERATOR, "--check")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (ROOT / "dashboards" / "json").glob("*.json")) == sorted(gen.DASHBOARDS)


def test_check_fails_when_the_committed_json_is_stale(tmp_path):
    script = copy_tree(tmp_path)
    path = tmp_path / "dashboards" / "json" / "layer.json"
    board = json.loads(path.read_text())
    board["panels"][1]["title"] = "edited by hand"
    path.write_text(json.dumps(board, indent=2, sort_keys=True) + "\n")
    proc = run(script, "--check")
    assert proc.returncode == 1
    assert "layer.json: differs from what the generator writes" in proc.stderr


def _break_generator(tmp_path: Path, old: str, new: str) -> subprocess.CompletedProcess:
    """Edit the copied generator's source, regenerate its JSON (so only the query is wrong), check."""
    script = copy_tree(tmp_path)
    source = script.read_text()
    assert source.count(old) == 1
    script.write_text(source.replace(old, new))
    assert run(script).returncode == 0
    return run(script, "--check")


def test_check_fails_on_a_metric_the_agent_does_not_export(tmp_path):
    proc = _break_generator(tmp_path, '"max(moewatch_layer_a2a_share_ratio{', '"max(moewatch_layer_a2a_shares_ratio{')
    assert proc.returncode == 1
    assert "moewatch_layer_a2a_shares_ratio is neither exported by the agent" in proc.stderr
    assert "differs" not in proc.stderr


def test_check_fails_on_a_query_that_does_not_parse(tmp_path):
    proc = _break_generator(tmp_path, "sum by (kind, result) (increase(moewatch_actions_total",
                            "sum by (kind, result) (increase((moewatch_actions_total")
    assert proc.returncode == 1
    assert "Actions by kind and result / A: does not parse" in proc.stderr
    assert "unclosed left parenthesis" in proc.stderr


def test_check_boards_flags_missing_ref_ids_and_unknown_variables():
    board = {"title": "t", "templating": {"list": [{"name": "layer", "type": "custom"}]},
             "panels": [{"title": "p", "targets": [{"expr": 'moewatch_epoch{model="$modle"}'},
                                                   {"refId": "B", "expr": "moewatch_epoch"}]}]}
    problems = gen.check_boards({"t.json": board})
    assert any("every query needs its own refId" in p for p in problems)
    assert any("$modle is not a variable of this dashboard" in p for p in problems)


@pytest.mark.parametrize("expr, names", [
    ('sum by (le) (rate(a_bucket{x="y", le=~"1"}[5m]))', {"a_bucket"}),
    ("histogram_quantile(0.99, sum without (instance) (rate(b_bucket[1m] offset 15m)))", {"b_bucket"}),
    ('a > 0.3 or (a and on (job, instance) group_left (mode) c{mode="x"} == bool 1)', {"a", "c"}),
    ("time() - max by (g) (level:metric:op) > 1e3", {"level:metric:op"}),
    ('label_replace(up == 0, "reason", "down", "", "") unless inf', {"up"}),
    ("max_over_time(d[5m:1m]) * 2 + 0x1f", {"d"}),
])
def test_metric_names_finds_the_selected_series(expr, names):
    assert gen.metric_names(expr) == names


def _names(board: dict) -> set[str]:
    out = set()
    for _, expr in gen.dashboard_queries(board):
        out |= gen.metric_names(gen.substitute(expr, {"model", "ep_group", "layer", "instance"})[0])
    return out


def _panel_types(board: dict) -> set[str]:
    return {p["type"] for p in gen._panels(board["panels"])}


def test_the_three_dashboards_show_what_operators_need():
    boards = {name: json.loads((ROOT / "dashboards" / "json" / name).read_text()) for name in gen.DASHBOARDS}
    overview, layer, agent = boards["overview.json"], boards["layer.json"], boards["agent.json"]
    assert {"layer:moewatch_layer_verdict:code", "moewatch_layer_unhealthy_windows",
            "layer:moewatch_layer_a2a_step_seconds:p99_5m", "group:moewatch_step_seconds:p50_5m",
            "group:moewatch_step_seconds:p99_5m", "moewatch_actions_total",
            "moewatch_rollbacks_total"} <= _names(overview)
    # the engine's own EPLB with moewatch's policy inside: every family the agent exports for it
    from moewatch.agent.metrics import engine_rebalance

    assert {family.name for family in engine_rebalance.FAMILIES} <= _names(overview)
    assert "state-timeline" in _panel_types(overview)
    assert {"layer:moewatch_layer_a2a_seconds:sum", "moewatch_layer_compute_seconds", "moewatch_rank_load_pairs",
            "moewatch_layer_expert_load_share_bucket", "moewatch_layer_cross_rank_ratio",
            "moewatch_layer_expected_cross_rank_ratio", "moewatch_layer_a2a_efficiency_ratio",
            "moewatch_layer_capacity_factor", "moewatch_layer_effective_capacity_factor",
            "layer:moewatch_layer_overflow_pairs:ratio_rate5m"} <= _names(layer)
    assert "heatmap" in _panel_types(layer)
    assert "layer" in {v["name"] for v in layer["templating"]["list"]}
    assert {"moewatch_frames_received_total", "moewatch_frames_rejected_total",
            "moewatch_runtime_frames_dropped_total", "group:moewatch_last_window:age_seconds",
            "moewatch_job_errors_total", "moewatch_agent_mode"} <= _names(agent)
    assert len({b["uid"] for b in boards.values()}) == 3
