"""Emulated links for real (runtime/netlinks.py, scripts/emulated_links.sh): namespaces, veths shaped
with tbf, gloo on them, the measured rate, the bound in the windows, cleanup after an end, a SIGTERM
and a SIGKILL; and the one-line refusals without root or without iproute2. CI runs as root: nothing
here skips; without root the real-run tests fail, naming what is missing."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from moewatch.runtime import netlinks
from moewatch.runtime.config import RuntimeConfig
from moewatch.runtime.launcher import launch

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "emulated_links.sh"
# Not root, as the refusals see it (EUID 65534), in a user namespace: the files keep being read as their
# owner's, so a checkout only its owner may enter (a clone under `mktemp -d`) still runs.
NOBODY = ["unshare", "--user", "--map-user=65534", "--map-group=65534"]


def _ours(pid: int) -> list[str]:
    """Namespaces and root-namespace links named by this owner pid."""
    names = os.listdir(netlinks.NETNS_DIR) if os.path.isdir(netlinks.NETNS_DIR) else []
    names += os.listdir("/sys/class/net")
    return sorted(n for n in names if n.startswith(f"{netlinks.PREFIX}{pid}") and not n[len(netlinks.PREFIX) + len(str(pid))].isdigit())


def test_a_run_on_shaped_links_measures_the_rate_and_carries_the_bound():
    netlinks.check_can_emulate()  # root and iproute2, as in CI: a clear failure otherwise, never a skip
    started = time.monotonic()
    cfg = RuntimeConfig(ranks=2, layers=2, experts=4, hidden=64, ffn=32, batch_tokens=64, steps=4, warmup_steps=1,
                        window_steps=4, link_rate_mbit=200.0, a2a_schedule="aurora", a2a_log=True,
                        return_windows=True, collective_timeout_s=30.0)
    result = launch(cfg)
    assert time.monotonic() - started < 90  # the deadline: links, measurement, the run and cleanup
    links = result.links
    assert links["rate_mbit"] == 200.0 and len(links["namespaces"]) == 2
    for achieved in links["achieved_over_rate"]:
        assert 0.8 < achieved < 1.05  # tbf holds the link near its rate (headers take a few %)
    assert result.config["link_bytes_per_second"] == links["link_bytes_per_second"]
    assert result.pairs_lost == 0
    window = result.windows[-1]
    assert window["a2a_bound_seconds"] is not None and len(window["a2a_over_bound"]) == 2
    assert all(v > 0 for v in window["a2a_bound_seconds"])
    a2a = result.a2a
    assert a2a["schedule"] == "aurora" and a2a["measured_steps"] == 3
    # (No comparison of the two here: rows this small fit in tbf's burst and can beat the rate.)
    assert all(s > 0 and b > 0 for s, b in zip(a2a["seconds_per_layer"], a2a["bound_seconds_per_layer"]))
    assert _ours(os.getpid()) == []  # namespaces and veths gone


def _ranks_running(namespace: str) -> bool:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return done.returncode == 0 and bool(done.stdout.strip())


def _wait_for_links(pid: int | None, timeout: float = 90.0) -> str:
    """The tag of the links `pid` made (any owner's when None), once a rank runs in rank 1's namespace
    (the group is past its setup: a stop now ends at a step boundary)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = _ours(pid) if pid is not None else [
            n for n in os.listdir(netlinks.NETNS_DIR) if n.startswith(netlinks.PREFIX)]
        for name in names:
            if name.endswith("r1") and _ranks_running(name):
                return name[:-2]
        time.sleep(0.2)
    raise AssertionError(f"no rank of pid {pid} ran in its namespace within {timeout} s")


def _long_run(*extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moewatch.cli", "runtime", "--ranks", "2", "--layers", "1",
                             "--experts", "4", "--hidden", "32", "--ffn", "32", "--batch-tokens", "16",
                             "--steps", "0", "--seconds", "120", "--link-rate", "100", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def test_sigterm_removes_the_links_and_sigkill_leaves_them_to_cleanup():
    netlinks.check_can_emulate()
    run = _long_run()
    try:
        _wait_for_links(run.pid)
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=60)
        assert _ours(run.pid) == []
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    run = _long_run()
    try:
        _wait_for_links(run.pid)
        os.killpg(run.pid, signal.SIGKILL)  # launcher and ranks: nothing can run a cleanup
        run.wait(timeout=30)
        left = _ours(run.pid)
        assert left, "a SIGKILL leaves the links behind (the case the sweep exists for)"
        done = subprocess.run(["bash", str(SCRIPT), "--cleanup"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert _ours(run.pid) == []
    finally:
        if run.poll() is None:
            run.kill()


def _wait_for_steps(windows: pathlib.Path, timeout: float = 90.0) -> None:
    """Until the run wrote a window: its ranks are in the step loop, where a stop ends at a boundary."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if windows.exists() and windows.stat().st_size > 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"the run wrote no window within {timeout} s")


def test_the_script_runs_the_runtime_and_sweeps_after_a_sigterm(tmp_path):
    netlinks.check_can_emulate()
    windows = tmp_path / "windows.jsonl"
    run = subprocess.Popen(["bash", str(SCRIPT), "100", "--ranks", "2", "--layers", "1", "--experts", "4",
                            "--hidden", "32", "--ffn", "32", "--batch-tokens", "16", "--steps", "0",
                            "--seconds", "120", "--window-steps", "1", "--windows-out", str(windows)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        tag = _wait_for_links(None)
        _wait_for_steps(windows)
        window = json.loads(windows.read_text().splitlines()[0])
        assert window["a2a_bound_seconds"] is not None  # measured rates: the bound goes into the windows
        run.send_signal(signal.SIGTERM)
        out, err = run.communicate(timeout=60)
        assert run.returncode == 143
        assert "links: 100 Mbit/s asked" in out  # the runtime stopped at a step boundary and reported
        assert not [n for n in os.listdir(netlinks.NETNS_DIR) if n.startswith(tag)]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)


def test_refusals_are_one_line():
    as_nobody = subprocess.run([*NOBODY, "bash", str(SCRIPT), "100"], capture_output=True, text=True, timeout=30)
    assert as_nobody.returncode == 2
    assert as_nobody.stderr.strip().splitlines() == ["emulated_links: needs root (network namespaces, veth and tc)"]
    no_tc = subprocess.run(["/bin/bash", str(SCRIPT), "100"], capture_output=True, text=True, timeout=30,
                           env={**os.environ, "PATH": "/nonexistent"})
    assert no_tc.returncode == 2 and len(no_tc.stderr.strip().splitlines()) == 1
    assert "needs `ip` (iproute2)" in no_tc.stderr
    cli = subprocess.run([*NOBODY, sys.executable, "-m", "moewatch.cli", "runtime", "--link-rate", "100"],
                         capture_output=True, text=True, timeout=60, cwd="/")
    assert cli.returncode == 2
    assert cli.stderr.strip().splitlines() == [
        "moewatch: error: runtime: --link-rate: emulated links need root (network namespaces, veth and tc); "
        "run as root or leave out --link-rate"]


def test_checks_without_root_or_tools(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(netlinks.LinkError, match="need root"):
        netlinks.check_can_emulate()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netlinks.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    with pytest.raises(netlinks.LinkError, match="need `tc`"):
        netlinks.check_can_emulate()
    with pytest.raises(netlinks.LinkError):
        netlinks.create(2, 100.0)
