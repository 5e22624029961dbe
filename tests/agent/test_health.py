"""Health: /healthz and /readyz without any runtime, systemd notify (READY, WATCHDOG, STOPPING), a clean
SIGTERM that leaves the audit log flushed, and failing checks that say why."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from moewatch.agent.audit import read_audit
from moewatch.agent.health import SystemdNotifier


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_ready_without_a_runtime_and_checks_that_fail_say_why(start_agent):
    daemon = start_agent()
    assert get(daemon.http_url + "/healthz")[0] == 200
    status, body = get(daemon.http_url + "/readyz")
    assert status == 200 and body["status"] == "ok"
    assert {c["name"] for c in body["checks"]} == {"scheduler", "socket", "audit_log"}
    daemon.audit.close()  # the audit log can no longer be written: not ready, still alive
    status, body = get(daemon.http_url + "/readyz")
    assert status == 503 and [c["name"] for c in body["checks"] if not c["ok"]] == ["audit_log"]
    assert get(daemon.http_url + "/healthz")[0] == 200
    daemon.jobs.shutdown()
    status, body = get(daemon.http_url + "/healthz")
    assert status == 503 and "scheduler stopped" in json.dumps(body)
    with urllib.request.urlopen(daemon.http_url + "/status", timeout=5) as resp:
        assert json.loads(resp.read())["agent"]["mode"] == "observe"


def test_head_answers_each_get_endpoint_as_get_without_a_body(start_agent):
    # Load balancers and uptime checkers probe with HEAD: same status and headers, no body.
    import http.client

    daemon = start_agent()
    host, port = daemon.http_url.removeprefix("http://").rsplit(":", 1)
    for path in ("/healthz", "/readyz", "/metrics", "/status", "/nowhere"):
        conn = http.client.HTTPConnection(host, int(port), timeout=5)
        try:
            conn.request("GET", path)
            got = conn.getresponse()
            get_status, get_type, get_body = got.status, got.getheader("Content-Type"), got.read()
            conn.request("HEAD", path)
            head = conn.getresponse()  # one connection: a body sent after HEAD would spoil the next answer
            assert (head.status, head.getheader("Content-Type")) == (get_status, get_type), path
            assert head.read() == b"", path
            if path not in ("/metrics", "/status"):  # their bodies change from one request to the next
                assert int(head.getheader("Content-Length")) == len(get_body), path
            conn.request("GET", "/healthz")
            assert conn.getresponse().status == 200, path
        finally:
            conn.close()


def test_notifier_speaks_sd_notify(short_tmp):
    path = str(short_tmp / "notify.sock")
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(path)
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())})
    assert notifier.enabled and notifier.watchdog_seconds == 2.0
    assert notifier.ready("hello") and notifier.watchdog() and notifier.stopping()
    sink.settimeout(1)
    assert [sink.recv(1024) for _ in range(3)] == [b"READY=1\nSTATUS=hello", b"WATCHDOG=1", b"STOPPING=1"]
    assert SystemdNotifier({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}).watchdog_seconds is None
    assert not SystemdNotifier({}).ready()


def test_agent_process_notifies_systemd_and_stops_cleanly_on_sigterm(short_tmp):
    notify_path = str(short_tmp / "notify.sock")
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(notify_path)
    sink.settimeout(30)
    audit = short_tmp / "state" / "audit.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOEWATCH_")}
    env.update({"NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "500000", "MOEWATCH_SERVER__LISTEN": "127.0.0.1:0",
                "MOEWATCH_SERVER__SOCKET": str(short_tmp / "agent.sock"), "MOEWATCH_LOG__AUDIT_LOG": str(audit)})
    proc = subprocess.Popen([sys.executable, "-m", "moewatch.cli", "agent"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        messages = []
        while not any(m.startswith("READY=1") for m in messages):
            messages.append(sink.recv(4096).decode())
        ready = next(m for m in messages if m.startswith("READY=1"))
        url = re.search(r"http (http://\S+)", ready).group(1)
        assert get(url + "/readyz")[0] == 200
        # The watchdog job pings every WATCHDOG_USEC / 2.
        deadline = time.monotonic() + 10
        pings = 0
        while pings < 2 and time.monotonic() < deadline:
            pings += sink.recv(4096) == b"WATCHDOG=1"
        assert pings == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        rest = []
        sink.settimeout(0.5)
        try:
            while True:
                rest.append(sink.recv(4096).decode())
        except socket.timeout:
            pass
        assert "STOPPING=1" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
    assert read_audit(audit)[-1]["event"] == "agent_stopped"
    assert not (short_tmp / "agent.sock").exists(), "the socket file is removed on a clean stop"


def _numba_loaded(pid: int) -> bool:
    return "/numba/" in Path(f"/proc/{pid}/maps").read_text()


def test_the_agent_process_plans_without_numba_unless_asked(short_tmp):
    """In act mode the agent's planner would load numba (over 100 MB of resident memory, more than a
    256Mi sidecar limit leaves): `moewatch agent` keeps numpy's loops unless MOEWATCH_PLANNER_COMPILED
    is set on, and then compiles them at start."""
    def start(tag: str, **extra: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOEWATCH_")}
        env.update({"MOEWATCH_SERVER__LISTEN": "127.0.0.1:0", "MOEWATCH_POLICY__MODE": "act",
                    "MOEWATCH_SERVER__SOCKET": str(short_tmp / f"{tag}.sock"),
                    "MOEWATCH_LOG__AUDIT_LOG": str(short_tmp / f"{tag}.jsonl"), **extra})
        return subprocess.Popen([sys.executable, "-m", "moewatch.cli", "agent"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def stop(proc: subprocess.Popen) -> str:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.communicate(timeout=30)[1]
        finally:
            if proc.poll() is None:
                proc.kill()

    asked = start("asked", MOEWATCH_PLANNER_COMPILED="1")
    began = time.monotonic()
    try:
        while not _numba_loaded(asked.pid) and time.monotonic() - began < 60 and asked.poll() is None:
            time.sleep(0.2)
        took = time.monotonic() - began
        assert _numba_loaded(asked.pid), "asked for, the compiled loops are loaded at start"
    finally:
        stop(asked)
    default = start("default")
    try:
        time.sleep(max(3.0, 2 * took))  # twice what the asked-for agent needed to load them
        assert default.poll() is None and not _numba_loaded(default.pid)
    finally:
        err = stop(default)
    assert "numba" not in err
