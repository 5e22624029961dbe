"""Configuration: defaults, YAML < MOEWATCH_* < flags, errors that name the field, docs that list every
setting, and the CLI's exit 2 on bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moewatch.agent.config import AgentConfig, build_config, describe
from moewatch.thresholds import ConfigError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "agent.md"


def test_defaults(monkeypatch):
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    cfg = build_config(environ={})
    assert cfg.mode == "observe"
    assert cfg.listen_address == ("127.0.0.1", 9477)
    assert cfg.socket == "/run/moewatch/moewatch.sock" and cfg.socket_mode_bits == 0o660
    assert cfg.audit_log == "/var/lib/moewatch/audit.jsonl"
    assert cfg.thresholds.comm_share == 0.5
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/a:/run/b")
    assert build_config(environ={}).socket == "/run/a/moewatch.sock"


def test_yaml_then_environment_then_flags(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text("mode: recommend\npersist_windows: 5\nlisten: 0.0.0.0:9100\n"
                    "thresholds:\n  comm_share: 0.4\n  rank_load_cv: 0.2\n")
    cfg = build_config(str(path), environ={})
    assert (cfg.mode, cfg.persist_windows, cfg.listen) == ("recommend", 5, "0.0.0.0:9100")
    assert cfg.thresholds.comm_share == 0.4 and cfg.thresholds.rank_load_cv == 0.2
    env = {"MOEWATCH_MODE": "act", "MOEWATCH_COMM_SHARE": "0.45", "MOEWATCH_EXPERT_METRICS": "yes"}
    cfg = build_config(str(path), environ=env)
    assert cfg.mode == "act" and cfg.thresholds.comm_share == 0.45 and cfg.expert_metrics is True
    cfg = build_config(str(path), environ=env, flags={"mode": "observe", "comm_share": 0.6, "persist_windows": None})
    assert cfg.mode == "observe" and cfg.thresholds.comm_share == 0.6 and cfg.persist_windows == 5
    assert cfg.thresholds.rank_load_cv == 0.2


@pytest.mark.parametrize("source,expected", [
    ({"yaml": "mode: sideways\n"}, r"agent.yaml: mode: 'sideways' is not one of observe, recommend, act"),
    ({"yaml": "modes: act\n"}, r"agent.yaml: modes: unknown setting"),
    ({"yaml": "comm_share: 0.3\n"}, r"comm_share: a threshold belongs under `thresholds:`"),
    ({"yaml": "thresholds:\n  comm_share: 2\n"}, r"thresholds.comm_share: .*outside"),
    ({"yaml": "thresholds:\n  nope: 2\n"}, r"thresholds.nope: unknown threshold"),
    ({"yaml": "- a\n- b\n"}, r"expected a mapping"),
    ({"env": {"MOEWATCH_PERSIST_WINDOWS": "three"}}, r"^MOEWATCH_PERSIST_WINDOWS: expected a number, got 'three'"),
    ({"env": {"MOEWATCH_RANK_LOAD_CV": "x"}}, r"^MOEWATCH_RANK_LOAD_CV: expected a number"),
    ({"env": {"MOEWATCH_EXPERT_METRICS": "maybe"}}, r"^MOEWATCH_EXPERT_METRICS: expected true or false"),
    ({"flags": {"listen": "localhost"}}, r"^listen: expected HOST:PORT"),
    ({"flags": {"listen": "127.0.0.1:70000"}}, r"^listen: port 70000"),
    ({"flags": {"socket_mode": "0999"}}, r"socket.mode: '0999' is not an octal mode"),
    ({"flags": {"cooldown_seconds": -1}}, r"^--cooldown-seconds: -1"),
    ({"flags": {"capacity_factor_min": 1.5, "capacity_factor_max": 1.2}}, r"^capacity_factor_min: 1.5 is above"),
    ({"flags": {"actuator": "sglang"}}, r"^sglang_location_file: required"),
])
def test_errors_name_the_field(tmp_path, source, expected):
    path = None
    if "yaml" in source:
        path = tmp_path / "agent.yaml"
        path.write_text(source["yaml"])
    with pytest.raises(ConfigError, match=expected):
        build_config(str(path) if path else None, environ=source.get("env", {}), flags=source.get("flags"))


def test_every_setting_has_a_flag_and_a_variable_and_is_documented():
    rows = describe()
    names = [r["name"] for r in rows]
    assert len(set(r["flag"] for r in rows)) == len(rows), "two settings share a flag"
    assert len(set(r["env"] for r in rows)) == len(rows), "two settings share a variable"
    assert "socket" in names and "listen" in names and "thresholds.comm_share" in names
    text = DOCS.read_text()
    for row in rows:
        for key in ("name", "flag", "env"):
            token = row[key].split(".")[-1] if key == "name" else row[key]
            assert re.search(rf"`{re.escape(token)}`", text), f"docs/agent.md lacks `{token}` ({row['name']})"


def run_cli(*args, env=None):
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MOEWATCH_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "moewatch.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=60)


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    bad_env = run_cli("agent", "--print-config", env={"MOEWATCH_PERSIST_WINDOWS": "0"})
    assert bad_env.returncode == 2
    assert bad_env.stderr.strip().splitlines() == [
        "moewatch: error: MOEWATCH_PERSIST_WINDOWS: 0 is outside [1, 10000]"]
    path = tmp_path / "agent.yaml"
    path.write_text("listen: nowhere\n")
    bad_yaml = run_cli("agent", "--config", str(path), "--print-config")
    assert bad_yaml.returncode == 2 and len(bad_yaml.stderr.strip().splitlines()) == 1
    assert "listen" in bad_yaml.stderr
    bad_flag = run_cli("agent", "--mode", "sideways")
    assert bad_flag.returncode == 2 and "sideways" in bad_flag.stderr


def test_cli_print_config_resolves_every_source(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text("mode: recommend\nthresholds:\n  comm_share: 0.4\n")
    out = run_cli("agent", "--config", str(path), "--print-config", "--socket", "/tmp/x.sock",
                  "--listen", "127.0.0.1:9999", "--rank-load-cv", "0.25", env={"MOEWATCH_PERSIST_WINDOWS": "7"})
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    assert cfg["mode"] == "recommend" and cfg["socket"] == "/tmp/x.sock" and cfg["listen"] == "127.0.0.1:9999"
    assert cfg["persist_windows"] == 7
    assert cfg["thresholds"]["comm_share"] == 0.4 and cfg["thresholds"]["rank_load_cv"] == 0.25


def test_config_is_frozen():
    cfg = AgentConfig(socket="/tmp/a.sock", audit_log="/tmp/a.jsonl")
    with pytest.raises(Exception):
        cfg.mode = "act"


def test_startup_problems_name_the_setting(tmp_path):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    base = ["agent", "--socket", str(tmp_path / "a.sock"), "--audit-log", str(tmp_path / "audit.jsonl")]
    busy = run_cli(*base, "--listen", f"127.0.0.1:{port}")
    assert busy.returncode == 2
    assert busy.stderr.strip().splitlines()[-1] == f"moewatch: error: listen: 127.0.0.1:{port}: Address already in use"
    nowhere = run_cli("agent", "--socket", "/proc/nowhere/a.sock", "--listen", "127.0.0.1:0",
                      "--audit-log", str(tmp_path / "audit.jsonl"))
    assert nowhere.returncode == 2 and "moewatch: error: socket: /proc/nowhere/a.sock:" in nowhere.stderr
    taken.close()
