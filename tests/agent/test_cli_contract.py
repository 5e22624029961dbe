"""The CLI contract for `moewatch agent` (issue 11): every startup or configuration error is one line
on stderr, `moewatch: error: ...`, and exit 2; nothing logged before it; no click usage block, no
traceback."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys

import pytest


def start_cli(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOEWATCH_")}
    return subprocess.Popen([sys.executable, "-m", "moewatch.cli", "agent", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
def test_every_startup_or_config_error_is_one_line_and_exit_2(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("policy:\n  mode: observe # caf\xe9\n".encode("latin-1"))
    twice = tmp_path / "twice.yaml"
    twice.write_text("policy:\n  mode: observe\nserver:\n  listen: 127.0.0.1:1\npolicy:\n  mode: act\n")
    twice_nested = tmp_path / "twice-nested.yaml"
    twice_nested.write_text("thresholds:\n  comm_share: 0.4\n  comm_share: 0.6\n")
    port_holder = socket.socket()
    port_holder.bind(("127.0.0.1", 0))
    port_holder.listen()
    port = port_holder.getsockname()[1]
    live_path = str(tmp_path / "live.sock")
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(live_path)
    live.listen()
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    paths = ["--socket", str(tmp_path / "a.sock"), "--log.audit-log", str(tmp_path / "audit.jsonl"),
             "--listen", "127.0.0.1:0"]
    cases = {
        "not utf-8": (["--config", str(latin1), "--print-config"], f"{latin1}: not UTF-8 text"),
        "config is a folder": (["--config", str(tmp_path), "--print-config"], f"{tmp_path}: is a folder"),
        "non-numeric flag": (["--history.windows", "many", "--print-config"], "'--history.windows'"),
        "flat flag of old": (["--history-windows", "8", "--print-config"], "--history-windows: moved to --history.windows"),
        "unknown flag": (["--no-such-flag", "--print-config"], "--no-such-flag"),
        "duplicate key": (["--config", str(twice), "--print-config"], "line 5: key 'policy' is given twice"),
        "duplicate nested key": (["--config", str(twice_nested), "--print-config"], "key 'comm_share' is given twice"),
        "port in use": ([*paths[:4], "--listen", f"127.0.0.1:{port}"],
                        f"server.listen: 127.0.0.1:{port}: Address already"),
        "unwritable audit log": ([*paths[:2], "--log.audit-log", str(a_file / "audit.jsonl"), *paths[4:]],
                                 f"log.audit_log: {a_file / 'audit.jsonl'}:"),
        "socket taken": (["--socket", live_path, *paths[2:]],
                         f"server.socket: another process is listening on {live_path}"),
        "tcp port in use": ([*paths, "--server.tcp-listen", f"127.0.0.1:{port}"],
                            f"server.tcp_listen: 127.0.0.1:{port}: Address"),
    }
    procs = {name: start_cli(*args) for name, (args, _) in cases.items()}
    try:
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=60)
            expected = cases[name][1]
            assert proc.returncode == 2, (name, err)
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("moewatch: error: "), (name, err)
            assert expected in lines[0], (name, lines[0])
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        port_holder.close()
    # The second agent left the live socket alone, and the failed ones removed the sockets they made.
    assert stat.S_ISSOCK(os.lstat(live_path).st_mode)
    assert not (tmp_path / "a.sock").exists()
    live.close()


def test_every_verb_takes_the_one_line_path():
    import importlib

    import click

    from moewatch.tools.bench import SUBCOMMANDS
    from moewatch.cli import VERBS
    from moewatch.cli_contract import OneLineCommand

    commands = {}
    for name, (target, _) in {**VERBS, **{f"bench {k}": v for k, v in SUBCOMMANDS.items()}}.items():
        module, attr = target.split(":")
        commands[name] = getattr(importlib.import_module(module), attr)
    leaves = {name: cmd for name, cmd in commands.items() if not isinstance(cmd, click.Group)}
    assert "bench" not in leaves and len(leaves) == len(commands) - 1
    assert [name for name, cmd in leaves.items() if not isinstance(cmd, OneLineCommand)] == []


@pytest.mark.parametrize("verb", ["diagnose", "plan", "agent", "report"])
def test_an_unknown_flag_is_one_line_and_exit_2_for_every_kind_of_verb(verb):
    proc = subprocess.run([sys.executable, "-m", "moewatch.cli", verb, "--no-such-flag"], capture_output=True,
                          text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(lines) == 1 and lines[0].startswith("moewatch: error: ") and "--no-such-flag" in lines[0]
