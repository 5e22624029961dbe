"""Configuration: sections with defaults, YAML < MOEWATCH_* < flags, errors that name the field by its full
path, the flat names of old refused with their new place, docs and the sample file generated from the
schema, and the CLI's exit 2 on bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moewatch.agent.config import AgentConfig, PolicySettings, build_config, describe, sample_config, settings_table
from moewatch.integrations.sglang.settings import SGLangSettings
from moewatch.thresholds import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "agent.md"
SAMPLE = ROOT / "agent" / "deploy" / "agent.yaml"
TABLE_BEGIN, TABLE_END = "<!-- settings: begin (generated) -->", "<!-- settings: end -->"


def test_defaults(monkeypatch):
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    cfg = build_config(environ={})
    assert cfg.policy.mode == "observe"
    assert cfg.server.listen_address == ("127.0.0.1", 9477)
    assert cfg.server.socket == "/run/moewatch/moewatch.sock" and cfg.server.socket_mode_bits == 0o660
    assert cfg.log.audit_log == "/var/lib/moewatch/audit.jsonl"
    assert cfg.thresholds.comm_share == 0.5
    assert isinstance(cfg.sglang, SGLangSettings) and cfg.sglang is cfg.engines["sglang"]
    assert cfg.sglang.actuate is False and cfg.sglang.apply_seconds == 1.8
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/a:/run/b")
    assert build_config(environ={}).server.socket == "/run/a/moewatch.sock"


def test_yaml_then_environment_then_flags(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text("policy:\n  mode: recommend\n  persist_windows: 5\nserver:\n  listen: 0.0.0.0:9100\n"
                    "thresholds:\n  comm_share: 0.4\n  rank_load_cv: 0.2\n")
    cfg = build_config(str(path), environ={})
    assert (cfg.policy.mode, cfg.policy.persist_windows, cfg.server.listen) == ("recommend", 5, "0.0.0.0:9100")
    assert cfg.thresholds.comm_share == 0.4 and cfg.thresholds.rank_load_cv == 0.2
    env = {"MOEWATCH_POLICY__MODE": "act", "MOEWATCH_THRESHOLDS__COMM_SHARE": "0.45",
           "MOEWATCH_EXPORTERS__EXPERT_METRICS": "yes", "MOEWATCH_MODEL": "the runtime's, left alone"}
    cfg = build_config(str(path), environ=env)
    assert cfg.policy.mode == "act" and cfg.thresholds.comm_share == 0.45 and cfg.exporters.expert_metrics is True
    cfg = build_config(str(path), environ=env, flags={"policy.mode": "observe", "thresholds.comm_share": 0.6,
                                                      "policy.persist_windows": None})
    assert cfg.policy.mode == "observe" and cfg.thresholds.comm_share == 0.6 and cfg.policy.persist_windows == 5
    assert cfg.thresholds.rank_load_cv == 0.2


def test_from_mapping_is_the_builder_of_tests_and_tools():
    cfg = AgentConfig.from_mapping({"policy": {"mode": "act", "persist_windows": 2}}, policy={"persist_windows": 4},
                                   verify={"windows": 5})
    assert (cfg.policy.mode, cfg.policy.persist_windows, cfg.verify.windows) == ("act", 4, 5)
    assert AgentConfig.from_mapping({"sglang.num_experts": 8, "thresholds.comm_share": 0.3}).sglang.num_experts == 8
    with pytest.raises(ConfigError, match=r"^policy.persist_windows: 0 is outside \[1, 10000\]$"):
        AgentConfig.from_mapping({"policy": {"persist_windows": 0}})


@pytest.mark.parametrize("source,expected", [
    ({"yaml": "policy:\n  mode: sideways\n"},
     r"agent.yaml: policy.mode: 'sideways' is not one of observe, recommend, act"),
    ({"yaml": "policy:\n  modes: act\n"}, r"agent.yaml: policy.modes: unknown setting"),
    ({"yaml": "polcy:\n  mode: act\n"}, r"agent.yaml: polcy: unknown section"),
    ({"yaml": "policy: act\n"}, r"agent.yaml: policy: expected a mapping of settings"),
    ({"yaml": "comm_share: 0.3\n"}, r"agent.yaml: comm_share: moved to thresholds.comm_share"),
    ({"yaml": "thresholds:\n  comm_share: 2\n"}, r"thresholds.comm_share: .*outside"),
    ({"yaml": "thresholds:\n  nope: 2\n"}, r"thresholds.nope: unknown threshold"),
    ({"yaml": "- a\n- b\n"}, r"expected a mapping"),
    ({"env": {"MOEWATCH_POLICY__PERSIST_WINDOWS": "three"}},
     r"^MOEWATCH_POLICY__PERSIST_WINDOWS: expected a number, got 'three'"),
    ({"env": {"MOEWATCH_THRESHOLDS__RANK_LOAD_CV": "x"}}, r"^MOEWATCH_THRESHOLDS__RANK_LOAD_CV: expected a number"),
    ({"env": {"MOEWATCH_EXPORTERS__EXPERT_METRICS": "maybe"}},
     r"^MOEWATCH_EXPORTERS__EXPERT_METRICS: expected true or false"),
    ({"env": {"MOEWATCH_POLICY__NOPE": "1"}}, r"^MOEWATCH_POLICY__NOPE: unknown setting"),
    ({"flags": {"server.listen": "localhost"}}, r"^server.listen: expected HOST:PORT"),
    ({"flags": {"server.listen": "127.0.0.1:70000"}}, r"^server.listen: port 70000"),
    ({"flags": {"server.socket_mode": "0999"}}, r"^--server.socket-mode: '0999' is not an octal mode"),
    ({"flags": {"policy.cooldown_seconds": -1}}, r"^--policy.cooldown-seconds: -1"),
    ({"flags": {"policy.capacity_factor_min": 1.5, "policy.capacity_factor_max": 1.2}},
     r"^policy.capacity_factor_min: 1.5 is above policy.capacity_factor_max 1.2"),
    ({"flags": {"sglang.actuate": True}}, r"^sglang.location_file: required"),
    ({"flags": {"limits.buffer_budget_bytes": 2048, "limits.max_frame_bytes": 4096}},
     r"^limits.buffer_budget_bytes: 2048 is below limits.max_frame_bytes 4096"),
])
def test_errors_name_the_field_by_its_full_path(tmp_path, source, expected):
    path = None
    if "yaml" in source:
        path = tmp_path / "agent.yaml"
        path.write_text(source["yaml"])
    with pytest.raises(ConfigError, match=expected):
        build_config(str(path) if path else None, environ=source.get("env", {}), flags=source.get("flags"))


@pytest.mark.parametrize("source,expected", [
    ({"yaml": "persist_windows: 3\n"}, r"agent.yaml: persist_windows: moved to policy.persist_windows$"),
    ({"yaml": "mode: act\n"}, r"agent.yaml: mode: moved to policy.mode$"),
    ({"yaml": "history_windows: 8\n"}, r"agent.yaml: history_windows: moved to history.windows$"),
    ({"yaml": "actuator: sglang\n"}, r"agent.yaml: actuator: moved to sglang.actuate$"),
    ({"yaml": "sglang_dump_dir: /d\n"}, r"agent.yaml: sglang_dump_dir: moved to sglang.dump_dir$"),
    ({"env": {"MOEWATCH_PERSIST_WINDOWS": "3"}},
     r"^MOEWATCH_PERSIST_WINDOWS: moved to MOEWATCH_POLICY__PERSIST_WINDOWS$"),
    ({"env": {"MOEWATCH_COMM_SHARE": "0.3"}}, r"^MOEWATCH_COMM_SHARE: moved to MOEWATCH_THRESHOLDS__COMM_SHARE$"),
    ({"env": {"MOEWATCH_LOG_LEVEL": "debug"}}, r"^MOEWATCH_LOG_LEVEL: moved to MOEWATCH_LOG__LEVEL$"),
    ({"flags": {"persist_windows": 3}}, r"^--persist-windows: moved to --policy.persist-windows$"),
])
def test_flat_names_of_old_are_refused_with_their_new_place(tmp_path, source, expected):
    path = None
    if "yaml" in source:
        path = tmp_path / "agent.yaml"
        path.write_text(source["yaml"])
    with pytest.raises(ConfigError, match=expected):
        build_config(str(path) if path else None, environ=source.get("env", {}), flags=source.get("flags"))


def test_every_setting_has_one_flag_and_one_variable_and_the_docs_table_is_the_generated_one():
    rows = describe()
    names = [r["name"] for r in rows]
    assert len(set(r["flag"] for r in rows)) == len(rows), "two settings share a flag"
    assert len(set(r["env"] for r in rows)) == len(rows), "two settings share a variable"
    assert "server.socket" in names and "server.listen" in names and "thresholds.comm_share" in names
    assert {r["section"] for r in rows} >= {"server", "limits", "policy", "verify", "exporters", "sglang"}
    assert len({r["section"] for r in rows}) <= 12
    text = DOCS.read_text()
    for row in rows:
        for key in ("field", "flag", "env"):
            assert re.search(rf"`{re.escape(row[key])}`", text), f"docs/agent.md lacks `{row[key]}` ({row['name']})"
    assert TABLE_BEGIN in text and TABLE_END in text
    table = text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0]
    assert table.strip() == settings_table().strip(), "docs/agent.md's table is stale: run scripts/config_docs.py"


def test_the_sample_config_is_the_generated_one_and_loads_to_the_defaults(monkeypatch):
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    assert SAMPLE.read_text() == sample_config(), "agent/deploy/agent.yaml is stale: run scripts/config_docs.py"
    assert build_config(str(SAMPLE), environ={}).to_dict() == build_config(environ={}).to_dict()


def test_the_generator_rewrites_both_files_and_the_check_fails_on_a_stale_one(tmp_path):
    docs, sample = tmp_path / "agent.md", tmp_path / "agent.yaml"
    docs.write_text(f"intro\n\n{TABLE_BEGIN}\nstale\n{TABLE_END}\n\nafter\n")
    sample.write_text("stale: true\n")
    script = ROOT / "scripts" / "config_docs.py"
    check = subprocess.run([sys.executable, str(script), "--check", "--docs", str(docs), "--sample", str(sample)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 1 and "stale" in check.stderr
    write = subprocess.run([sys.executable, str(script), "--docs", str(docs), "--sample", str(sample)],
                           capture_output=True, text=True, timeout=60)
    assert write.returncode == 0, write.stderr
    assert sample.read_text() == sample_config()
    assert docs.read_text().startswith("intro\n") and docs.read_text().endswith("\nafter\n")
    assert settings_table().strip() in docs.read_text()


def run_cli(*args, env=None):
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MOEWATCH_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "moewatch.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=60)


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    bad_env = run_cli("agent", "--print-config", env={"MOEWATCH_POLICY__PERSIST_WINDOWS": "0"})
    assert bad_env.returncode == 2
    assert bad_env.stderr.strip().splitlines() == [
        "moewatch: error: MOEWATCH_POLICY__PERSIST_WINDOWS: 0 is outside [1, 10000]"]
    path = tmp_path / "agent.yaml"
    path.write_text("server:\n  listen: nowhere\n")
    bad_yaml = run_cli("agent", "--config", str(path), "--print-config")
    assert bad_yaml.returncode == 2 and len(bad_yaml.stderr.strip().splitlines()) == 1
    assert "server.listen" in bad_yaml.stderr
    bad_flag = run_cli("agent", "--mode", "sideways")
    assert bad_flag.returncode == 2 and "sideways" in bad_flag.stderr
    for old, new in (("--persist-windows", "--policy.persist-windows"), ("--comm-share", "--thresholds.comm-share"),
                     ("--expert-metrics", "--exporters.expert-metrics")):
        refused = run_cli("agent", old, *([] if old == "--expert-metrics" else ["3"]), "--print-config")
        assert refused.returncode == 2
        assert refused.stderr.strip().splitlines() == [f"moewatch: error: {old}: moved to {new}"]
    old_env = run_cli("agent", "--print-config", env={"MOEWATCH_MODE": "act"})
    assert old_env.returncode == 2
    assert old_env.stderr.strip().splitlines() == ["moewatch: error: MOEWATCH_MODE: moved to MOEWATCH_POLICY__MODE"]


def test_cli_print_config_resolves_every_source(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text("policy:\n  mode: recommend\nthresholds:\n  comm_share: 0.4\n")
    out = run_cli("agent", "--config", str(path), "--print-config", "--socket", "/tmp/x.sock",
                  "--server.listen", "127.0.0.1:9999", "--thresholds.rank-load-cv", "0.25",
                  "--exporters.expert-metrics", env={"MOEWATCH_POLICY__PERSIST_WINDOWS": "7"})
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    assert cfg["policy"]["mode"] == "recommend" and cfg["server"]["socket"] == "/tmp/x.sock"
    assert cfg["server"]["listen"] == "127.0.0.1:9999" and cfg["exporters"]["expert_metrics"] is True
    assert cfg["policy"]["persist_windows"] == 7
    assert cfg["thresholds"]["comm_share"] == 0.4 and cfg["thresholds"]["rank_load_cv"] == 0.25
    assert cfg["sglang"]["actuate"] is False


def test_config_is_frozen():
    cfg = AgentConfig.from_mapping({"server": {"socket": "/tmp/a.sock"}, "log": {"audit_log": "/tmp/a.jsonl"}})
    with pytest.raises(Exception):
        cfg.policy = PolicySettings(mode="act")
    with pytest.raises(Exception):
        cfg.policy.mode = "act"
    with pytest.raises(TypeError):
        cfg.engines["sglang"] = SGLangSettings()


def test_startup_problems_name_the_setting(tmp_path):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    base = ["agent", "--socket", str(tmp_path / "a.sock"), "--log.audit-log", str(tmp_path / "audit.jsonl")]
    busy = run_cli(*base, "--listen", f"127.0.0.1:{port}")
    assert busy.returncode == 2
    assert busy.stderr.strip().splitlines()[-1] == \
        f"moewatch: error: server.listen: 127.0.0.1:{port}: Address already in use"
    nowhere = run_cli("agent", "--socket", "/proc/nowhere/a.sock", "--listen", "127.0.0.1:0",
                      "--log.audit-log", str(tmp_path / "audit.jsonl"))
    assert nowhere.returncode == 2 and "moewatch: error: server.socket: /proc/nowhere/a.sock:" in nowhere.stderr
    taken.close()
