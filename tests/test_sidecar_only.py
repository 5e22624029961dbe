"""The sidecar-only install (`pip install .`, no extras) runs `moewatch agent` and `moewatch diagnose`:
both run here under an import hook that fails on everything the base install lacks (torch,
matplotlib, OpenTelemetry) and on the tools package, which the sidecar must never import."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from importlib.metadata import requires
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("torch", "triton", "matplotlib", "opentelemetry", "moewatch.tools")
HOOK = f"""
import importlib.abc, sys
BLOCKED = {BLOCKED!r}
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"blocked for the sidecar-only check: {{name}}", name=name)
        return None
sys.meta_path.insert(0, Blocked())
"""
RUN_CLI = HOOK + """
import moewatch.cli, moewatch.agent.daemon, moewatch.triage
sys.argv = ["moewatch", *sys.argv[1:]]
moewatch.cli.main()
"""


def _sidecar(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUN_CLI, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, **kwargs)


def _base_requirements() -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: the installed metadata says the same
        return [r for r in requires("moewatch") or [] if "extra ==" not in r]
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def test_the_base_install_needs_no_extra():
    base = _base_requirements()
    assert base
    assert not [r for r in base if re.match(r"(torch|triton|matplotlib|opentelemetry)", r)], base


def test_the_hook_does_block():
    out = subprocess.run([sys.executable, "-c", HOOK + "import matplotlib"], capture_output=True, text=True)
    assert out.returncode != 0 and "blocked for the sidecar-only check" in out.stderr


def test_diagnose_runs_without_the_extras():
    out = _sidecar("diagnose", "examples/imbalance-hot-experts.json", "--json")
    assert out.returncode == 0, out.stderr
    verdicts = {layer["verdict"] for layer in json.loads(out.stdout)["layers"]}
    assert verdicts == {"imbalance-bound"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_agent_starts_and_answers_healthz_without_the_extras(tmp_path):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", RUN_CLI, "agent", "--socket", str(tmp_path / "a.sock"),
                             "--listen", f"127.0.0.1:{port}", "--log.audit-log", str(tmp_path / "audit.jsonl")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, status = time.monotonic() + 60, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
                    status = resp.status
                    break
            except OSError:
                time.sleep(0.2)
        assert status == 200, proc.stderr.read() if proc.poll() is not None else "no answer on /healthz"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0, proc.stderr.read()


def test_report_without_matplotlib_names_the_extra(tmp_path):
    out = _sidecar("report", "examples/healthy.json", "--out", str(tmp_path / "w.png"))
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and "pip install 'moewatch[report]'" in out.stderr


def test_an_otlp_endpoint_without_opentelemetry_refuses_to_start(tmp_path):
    out = _sidecar("agent", "--socket", str(tmp_path / "a.sock"), "--listen", "127.0.0.1:0",
                   "--log.audit-log", str(tmp_path / "audit.jsonl"), "--exporters.otlp-endpoint", "http://127.0.0.1:4318",
                   env={**os.environ})
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "pip install 'moewatch[otel]'" in out.stderr
