"""The HTTP listener under hostile clients (issue 11): optional TLS and basic authentication, a bound
on connections served at once, idle connections closed, and the agent out of file descriptors."""

from __future__ import annotations

import base64
import socket
import ssl
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest

OPENSSL = "openssl"  # found on PATH (make system-deps installs it)


def self_signed(folder):
    cert, key = folder / "tls.crt", folder / "tls.key"
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def get(url, context=None, auth=None):
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_https_and_basic_auth_guard_metrics_while_probes_stay_open(start_agent, short_tmp):
    cert, key = self_signed(short_tmp)
    (short_tmp / "password").write_text("s3cret\n")
    daemon = start_agent(server={"tls_cert_file": str(cert), "tls_key_file": str(key), "basic_auth_user": "prometheus",
                                 "basic_auth_password_file": str(short_tmp / "password")})
    assert daemon.http_url.startswith("https://")
    ctx = ssl.create_default_context(cafile=str(cert))
    assert get(daemon.http_url + "/metrics", ctx)[0] == 401
    assert get(daemon.http_url + "/metrics", ctx, auth="prometheus:wrong")[0] == 401
    status, body = get(daemon.http_url + "/metrics", ctx, auth="prometheus:s3cret")
    assert status == 200 and b"moewatch_agent_info" in body
    assert get(daemon.http_url + "/status", ctx)[0] == 401
    assert get(daemon.http_url + "/healthz", ctx)[0] == 200
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP is not served on the TLS port
        get(daemon.http_url.replace("https://", "http://") + "/healthz")
    # A client that connects and never finishes its handshake does not stop the others.
    stuck = socket.create_connection(("127.0.0.1", daemon.web.port))
    assert get(daemon.http_url + "/healthz", ctx)[0] == 200
    stuck.close()


def test_tls_files_that_do_not_load_name_the_setting(short_tmp):
    from moewatch.agent.config import AgentConfig
    from moewatch.agent.daemon import Daemon, StartupError

    (short_tmp / "bad.pem").write_text("not a certificate\n")
    cfg = AgentConfig.from_mapping({"server": {"socket": str(short_tmp / "a.sock"), "listen": "127.0.0.1:0",
                                               "tls_cert_file": str(short_tmp / "bad.pem"),
                                               "tls_key_file": str(short_tmp / "bad.pem")},
                                    "log": {"audit_log": str(short_tmp / "audit.jsonl")}})
    daemon = Daemon(cfg)
    with pytest.raises(StartupError, match="^server.tls_cert_file: "):
        daemon.start()
    daemon.stop(quiet=True)
    assert not (short_tmp / "a.sock").exists()


def test_http_connections_are_bounded_and_idle_ones_closed(start_agent, helpers):
    daemon = start_agent(server={"max_http_connections": 2, "http_idle_seconds": 3})
    refused = lambda: daemon.metrics.get("moewatch_connections_refused_total", ("http_max_connections",))  # noqa
    # Requests under way hold the serving slots: a third one is refused and counted.
    started = []
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", daemon.web.port))
        s.sendall(b"GET /healthz HTTP/1.1\r\n")  # and never the rest
        started.append(s)
    assert helpers.wait_for(lambda: refused() == 1)
    # Connections that send nothing hold no slot: at most 4 x max_http_connections wait, the oldest
    # give way, and /healthz is answered all along.
    idle = [socket.create_connection(("127.0.0.1", daemon.web.port)) for _ in range(10)]
    assert helpers.wait_for(lambda: daemon.web.server.idle.evicted == 2, timeout=2)
    for s in idle[:2]:
        s.settimeout(5)
        assert s.recv(1024) == b""
    # The served ones and the idle ones are closed after http_idle_seconds; /healthz answers again.
    for s in started + idle:
        s.settimeout(5)
        assert s.recv(1024) is not None
    assert helpers.wait_for(lambda: get(daemon.http_url + "/healthz")[0] == 200)
    assert refused() == 1
    for s in started + idle:
        s.close()


AGENT_UNDER_FD_LIMIT = textwrap.dedent("""
    import os, resource, sys, time
    from moewatch.agent.config import AgentConfig
    from moewatch.agent.daemon import Daemon
    folder = sys.argv[2]
    daemon = Daemon(AgentConfig.from_mapping({"server": {"socket": folder + "/a.sock", "listen": "127.0.0.1:0"},
                                              "log": {"audit_log": folder + "/audit.jsonl",
                                                      "interval_seconds": 3600}})).start()
    # Leave the process a handful of descriptors, as a low LimitNOFILE with busy peers would.
    used = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 4, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    print(daemon.web.port, flush=True)
    sys.stdin.readline()
    print(daemon.metrics.get("moewatch_connections_refused_total", ("out_of_descriptors",)),
          daemon.receiver.accept_failures, flush=True)
    daemon.stop()
""")


@pytest.mark.slow
def test_out_of_descriptors_is_logged_once_refused_and_does_not_spin(short_tmp, helpers):
    import logging  # noqa: F401 (the child logs through basicConfig below)

    child = subprocess.Popen(
        [sys.executable, "-c", "import logging, sys; logging.basicConfig(stream=sys.stderr); "
         "exec(sys.argv[1])", AGENT_UNDER_FD_LIMIT, str(short_tmp)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        peers = []
        for _ in range(30):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(short_tmp / "a.sock"))
            peers.append(s)
        time.sleep(1.5)  # flooded for a while: a spinning accept loop would burn this whole time
        for s in peers:
            s.close()
        # Descriptors back: /healthz answers.
        assert helpers.wait_for(lambda: get(f"http://127.0.0.1:{port}/healthz")[0] == 200)
        child.stdin.write("\n")
        child.stdin.flush()
        refused, failures = map(float, child.stdout.readline().split())
        child.stdin.close()
        err = child.stderr.read()
        child.wait(timeout=30)
    finally:
        child.kill()
    assert refused >= 1
    # Each failed accept pauses the listeners for half a second: a handful over the flood, where a
    # spinning loop fails tens of thousands of times.
    assert failures < 50, failures
    # Once per listener: the socket's accept loop always hits it; the HTTP listener may too when the
    # probe above arrives before the agent has seen the peers go.
    assert err.count("moewatch.agent.receiver:out of file descriptors") == 1, err
    assert err.count("moewatch.agent.health:http: out of file descriptors") <= 1, err
