"""The alert and recording rules: promtool accepts them, their unit tests pass and can fail, every
alert is tested both ways, and each alert's threshold, metrics and runbook link hold up."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from moewatch.thresholds import Thresholds

ROOT = Path(__file__).resolve().parents[2]
RULE_FILES = sorted(ROOT.glob("alerts/*.yml"))
TEST_FILES = sorted(ROOT.glob("alerts/tests/*.yml"))
RUNBOOK = ROOT / "docs" / "runbook.md"
SEVERITIES = {"critical", "warning", "info"}


def load_generator():
    """dashboards/generate.py is a script, not a package: load it by path."""
    spec = importlib.util.spec_from_file_location("moewatch_dashboards_generate", ROOT / "dashboards" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    # No skip when promtool is missing: `make test` installs it, and CI must fail without it.
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def rules(kind: str) -> list[dict]:
    out = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            out += [r for r in group["rules"] if kind in r]
    return out


ALERTS = {r["alert"]: r for r in rules("alert")}
RECORDS = {r["record"]: r for r in rules("record")}


def test_rule_files_exist_and_promtool_accepts_them():
    assert RULE_FILES and TEST_FILES
    assert len(ALERTS) >= 12 and len(RECORDS) >= 10
    proc = promtool("check", "rules", *map(str, RULE_FILES))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_unit_tests_pass():
    proc = promtool("test", "rules", *map(str, TEST_FILES))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_has_a_firing_and_a_silent_case():
    firing, silent = set(), set()
    for path in TEST_FILES:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for t in case.get("alert_rule_test", []):
                (firing if t.get("exp_alerts") else silent).add(t["alertname"])
    assert firing >= set(ALERTS), f"never shown firing: {sorted(set(ALERTS) - firing)}"
    assert silent >= set(ALERTS), f"never shown silent: {sorted(set(ALERTS) - silent)}"


def test_every_recording_rule_is_evaluated_in_a_unit_test():
    exprs = " ".join(t["expr"] for path in TEST_FILES for case in yaml.safe_load(path.read_text())["tests"]
                     for t in case.get("promql_expr_test", []))
    assert not [r for r in RECORDS if r not in exprs]


def _mutated_run(tmp_path: Path, expr: str, drop_for: bool) -> str:
    """Run the unit tests against copies of the rules whose every alert expression is `expr`."""
    (tmp_path / "alerts" / "tests").mkdir(parents=True)
    for path in TEST_FILES:
        shutil.copy(path, tmp_path / "alerts" / "tests" / path.name)
    for path in RULE_FILES:
        doc = yaml.safe_load(path.read_text())
        for group in doc["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    rule["expr"] = expr
                    if drop_for:
                        rule.pop("for", None)
        (tmp_path / "alerts" / path.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = promtool("test", "rules", *[f"alerts/tests/{p.name}" for p in TEST_FILES], cwd=tmp_path)
    assert proc.returncode != 0
    return proc.stdout + proc.stderr


def test_unit_tests_fail_for_every_alert_that_never_fires(tmp_path):
    out = _mutated_run(tmp_path, "vector(1) < 0", drop_for=False)
    failed = set(re.findall(r"alertname: (\w+), time: [^,]+,\s*exp:\[\s*0:", out))
    assert failed == set(ALERTS)


def test_unit_tests_fail_for_every_alert_that_always_fires(tmp_path):
    out = _mutated_run(tmp_path, "vector(1)", drop_for=True)
    failed = set(re.findall(r"alertname: (\w+), time: [^,]+,\s*exp:\[\],", out))
    assert failed == set(ALERTS)


def _anchors(markdown: str) -> dict[str, str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    out = {}
    for heading in re.findall(r"^#{1,6} (.+)$", markdown, re.M):
        out[re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")] = heading.strip()
    return out


@pytest.mark.parametrize("name", sorted(ALERTS))
def test_alert_carries_severity_numbers_and_runbook_section(name):
    rule = ALERTS[name]
    assert rule["labels"]["severity"] in SEVERITIES
    notes = rule["annotations"]
    assert set(notes) >= {"summary", "description", "runbook_url"}
    # The description carries the measured number, or for presence alerts the labels that say who.
    assert "$value" in notes["description"] or "$labels" in notes["description"]
    assert "$labels" in notes["summary"] or "$value" in notes["summary"]
    url = notes["runbook_url"]
    assert url == f"docs/runbook.md#{name.lower()}"
    anchors = _anchors(RUNBOOK.read_text())
    assert anchors.get(name.lower()) == name, f"docs/runbook.md has no '## {name}' section"


def test_runbook_has_no_section_for_an_alert_that_does_not_exist():
    sections = re.findall(r"^## (\w+)$", RUNBOOK.read_text(), re.M)
    assert sorted(sections) == sorted(ALERTS)


# Alert -> the thresholds.py fields its expression compares against, and how it writes them.
THRESHOLD_USES = {
    "MoeLayerRankLoadImbalanced": [("rank_load_cv", "moewatch_layer_rank_load_cv_ratio > {}"),
                                   ("rank_load_max_mean", "moewatch_layer_rank_load_max_mean_ratio > {}")],
    "MoeLayerExpertLoadSkewed": [("expert_load_cv", "moewatch_layer_expert_load_cv_ratio > {}")],
    "MoeLayerAllToAllP99High": [("a2a_p99_seconds", "layer:moewatch_layer_a2a_step_seconds:p99_5m > {}")],
    "MoeLayerOverflowHigh": [("overflow_rate", "layer:moewatch_layer_overflow_pairs:ratio_rate5m > {}")],
    "MoeLayerEffectiveCapacityLow": [("effective_capacity_factor", "moewatch_layer_effective_capacity_factor < {}")],
}


@pytest.mark.parametrize("name", sorted(THRESHOLD_USES))
def test_alert_threshold_is_the_one_in_thresholds_py(name):
    defaults = Thresholds()
    expr = " ".join(ALERTS[name]["expr"].split())
    for field, pattern in THRESHOLD_USES[name]:
        assert pattern.format(f"{getattr(defaults, field):g}") in expr, (name, field)
        # The number is quoted in the description too (as written or as a percentage).
        value = getattr(defaults, field)
        shown = {f"{value:g}", f"{value * 100:g}%", f"{value * 1e3:g}ms"}
        assert any(s in ALERTS[name]["annotations"]["description"] for s in shown), (name, field)


def test_rules_name_only_exported_or_recorded_metrics():
    generator = load_generator()
    known = generator.known_metrics(ROOT)
    for rule in [*ALERTS.values(), *RECORDS.values()]:
        unknown = generator.metric_names(rule["expr"]) - known
        assert not unknown, (rule.get("alert") or rule.get("record"), unknown)
        # Names read by annotation templates (the `query` function) count too.
        for text in rule.get("annotations", {}).values():
            assert set(re.findall(r"\bmoewatch_[a-z0-9_]+", text)) <= known


def test_recording_rules_follow_level_metric_operation():
    for name in RECORDS:
        level, metric, operation = name.split(":")
        assert level in {"layer", "group", "fleet"} and metric.startswith("moewatch_") and operation, name
