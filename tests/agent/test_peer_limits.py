"""Silent peers and idle HTTP connections never keep a runtime or a scrape out: a connection without a
hello gives way (at its deadline, or to a newcomer at max_connections), and /metrics is answered
while hundreds of idle HTTP connections are open."""

from __future__ import annotations

import socket
import urllib.request

L, E, P, W = 2, 8, 12, 4


def closed(daemon, reason):
    return daemon.metrics.get("moewatch_connections_closed_total", (reason,), 0.0)


def silent_unix(path: str, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        socks.append(s)
    return socks


def test_a_connection_without_a_hello_is_closed_at_the_deadline(start_agent, helpers):
    daemon = start_agent(limits={"hello_deadline_seconds": 0.3})
    (silent,) = silent_unix(daemon.cfg.server.socket, 1)
    rt = helpers.FakeRuntime(daemon.cfg.server.socket).connect()
    group = helpers.wait_group(daemon)
    assert helpers.wait_for(lambda: closed(daemon, "hello_deadline") == 1)
    silent.settimeout(3)
    assert silent.recv(1) == b""  # closed by the agent
    # The runtime that said hello stays, past the deadline, and is served.
    assert [c.hello is not None for c in daemon.receiver.connections()] == [True]
    rt.send(helpers.make_window(helpers.hot_load(L, E), helpers.contiguous(L, E, P), W))
    assert helpers.wait_for(lambda: len(group.history) == 1)
    text = helpers.scrape(daemon.http_url)
    assert helpers.sample_value(text, "moewatch_connections_closed_total", reason="hello_deadline") == 1
    rt.close()
    silent.close()


def test_at_the_connection_limit_silent_peers_give_way_to_a_runtime(start_agent, helpers):
    daemon = start_agent(limits={"max_connections": 20})
    socks = silent_unix(daemon.cfg.server.socket, 20)
    try:
        assert helpers.wait_for(lambda: len(daemon.receiver.connections()) == 20)
        oldest = min(daemon.receiver.connections(), key=lambda c: c.opened_at).id
        rt = helpers.FakeRuntime(daemon.cfg.server.socket, model="late").connect()
        group = helpers.wait_group(daemon, ("late", "g"))
        rt.send(helpers.make_window(helpers.hot_load(L, E), helpers.contiguous(L, E, P), W, model="late"))
        assert helpers.wait_for(lambda: len(group.history) == 1)
        assert daemon.metrics.get("moewatch_connections_refused_total", ("max_connections",)) == 0
        assert closed(daemon, "hello_evicted") == 1
        ids = {c.id for c in daemon.receiver.connections()}
        assert len(ids) == 20 and oldest not in ids
        socks[0].settimeout(3)
        assert socks[0].recv(1) == b""  # the oldest silent one went
        rt.close()
    finally:
        for s in socks:
            s.close()


def test_metrics_are_served_while_200_idle_http_connections_are_open(start_agent, helpers):
    daemon = start_agent()
    rt = helpers.FakeRuntime(daemon.cfg.server.socket).connect()
    group = helpers.wait_group(daemon)
    rt.send(helpers.make_window(helpers.hot_load(L, E), helpers.contiguous(L, E, P), W))
    assert helpers.wait_for(lambda: len(group.history) == 1)
    port = daemon.web.port
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(200)]
    try:
        for _ in range(5):
            with urllib.request.urlopen(daemon.http_url + "/metrics", timeout=5) as resp:
                assert resp.status == 200
                body = resp.read().decode()
            assert helpers.sample_value(body, "moewatch_layer_balancedness_ratio", model="m", layer="0") is not None
        assert daemon.metrics.get("moewatch_connections_refused_total", ("http_max_connections",)) == 0
    finally:
        for s in idle:
            s.close()
        rt.close()
