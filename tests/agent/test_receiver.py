"""Bad input on the socket: rejected and counted, while the agent keeps serving; reconnects."""

from __future__ import annotations

import json
import os
import stat
import struct

import numpy as np

from moewatch import wire
from moewatch.telemetry import Window, WindowError


def break_slot_tokens(blob: bytes) -> bytes:
    """A binary window whose slot_tokens no longer add up (one pair too many in slot 0)."""
    (head_len,) = struct.unpack_from("<I", blob, 4)
    header = json.loads(blob[8:8 + head_len])
    spec = header["arrays"]["slot_tokens"]
    base = 8 + head_len + ((-(8 + head_len)) % 8) + spec["offset"]
    out = bytearray(blob)
    value = np.frombuffer(out, dtype=spec["dtype"], count=1, offset=base).copy()
    out[base:base + value.itemsize] = (value + 1).tobytes()
    return bytes(out)


def rejected(daemon, reason):
    return daemon.metrics.get("moewatch_frames_rejected_total", (reason,), 0.0)


def test_socket_mode_and_good_windows(start_agent, helpers):
    daemon = start_agent()
    assert stat.S_IMODE(os.stat(daemon.cfg.server.socket).st_mode) == 0o660
    rt = helpers.FakeRuntime(daemon.cfg.server.socket).connect()
    pmap = helpers.contiguous(2, 8, 12)
    for i in range(3):
        rt.send(helpers.make_window(helpers.hot_load(), pmap, 4, start_time=1000.0 + i * 10))
    group = helpers.wait_group(daemon)
    assert helpers.wait_for(lambda: group is not None and len(group.history) == 3)
    assert daemon.metrics.get("moewatch_frames_received_total", ("window",)) == 3
    assert daemon.metrics.get("moewatch_runtime_connected", ("m", "g")) == 1


def test_bad_frames_are_rejected_counted_and_the_agent_keeps_serving(start_agent, helpers):
    daemon = start_agent(limits={"max_frame_bytes": 65536})
    pmap = helpers.contiguous(2, 8, 12)
    load = helpers.hot_load()

    # Out of order: a window before any hello.
    early = helpers.FakeRuntime(daemon.cfg.server.socket).connect(hello=False)
    early.send(helpers.make_window(load, pmap, 4))
    assert helpers.wait_for(lambda: rejected(daemon, "out_of_order") == 1)

    rt = helpers.FakeRuntime(daemon.cfg.server.socket).connect()
    rt.send(helpers.make_window(load, pmap, 4, start_time=1000.0))
    group = helpers.wait_group(daemon)
    assert helpers.wait_for(lambda: len(group.history) == 1)

    # Malformed: a good header around a payload that does not parse (the stream goes on).
    junk = b"{not json"
    rt.send_raw(wire.HEADER.pack(wire.MAGIC, wire.PROTOCOL_VERSION, int(wire.FrameType.HEARTBEAT), len(junk)) + junk)
    # Invalid: a window payload that breaks an invariant.
    broken = break_slot_tokens(helpers.make_window(load, pmap, 4, start_time=1010.0).to_bytes())
    rt.send_raw(wire.HEADER.pack(wire.MAGIC, wire.PROTOCOL_VERSION, int(wire.FrameType.WINDOW), len(broken)) + broken)
    # Out of order: ends before the previous window.
    rt.send(helpers.make_window(load, pmap, 4, start_time=900.0))
    # Mismatch: another model's window on this connection.
    rt.send(helpers.make_window(load, pmap, 4, start_time=1020.0, model="other"))
    # Stale epoch: the agent learns epoch 2 is in force, then an epoch-1 window arrives.
    rt.send(helpers.make_window(load, pmap, 4, start_time=1030.0, epoch=2))
    rt.send(helpers.make_window(load, pmap, 4, start_time=1040.0, epoch=1))
    # An ack for no plan: stale.
    rt.send(wire.Ack(plan_epoch=7, epoch_in_force=2, ok=True))
    # Still serving the same connection.
    rt.send(helpers.make_window(load, pmap, 4, start_time=1050.0, epoch=2))
    assert helpers.wait_for(lambda: len(group.history) == 3)
    assert rejected(daemon, "malformed") == 1
    assert rejected(daemon, "invalid_window") == 1
    assert rejected(daemon, "out_of_order") == 2
    assert rejected(daemon, "mismatch") == 1
    assert rejected(daemon, "stale_epoch") == 2  # the window and the ack

    # Oversized: the header announces more than max_frame_bytes; that connection is closed...
    rt.send_raw(wire.HEADER.pack(wire.MAGIC, wire.PROTOCOL_VERSION, int(wire.FrameType.WINDOW), 1 << 20))
    assert helpers.wait_for(lambda: rejected(daemon, "oversized") == 1)
    assert rt.closed_by_peer()
    # ... and a bad magic closes another; the counts say why.
    bad = helpers.FakeRuntime(daemon.cfg.server.socket).connect(hello=False)
    bad.send_raw(b"XX" + bytes(6))
    assert helpers.wait_for(lambda: rejected(daemon, "malformed") == 2)
    assert bad.closed_by_peer()

    # The runtime comes back: picked up again, windows flow, the /metrics text shows the counts.
    back = helpers.FakeRuntime(daemon.cfg.server.socket, epoch=2).connect()
    back.send(helpers.make_window(load, pmap, 4, start_time=2000.0, epoch=2))
    assert helpers.wait_for(lambda: len(group.history) == 4)
    assert group.connected
    text = helpers.scrape(daemon.http_url)
    assert helpers.sample_value(text, "moewatch_frames_rejected_total", reason="oversized") == 1
    assert helpers.sample_value(text, "moewatch_windows_total", model="m", ep_group="g") == 4
    assert helpers.sample_value(text, "moewatch_runtime_connected", model="m", ep_group="g") == 1


def test_disconnect_and_reconnect_is_picked_up(start_agent, helpers):
    daemon = start_agent()
    pmap = helpers.contiguous(2, 8, 12)
    rt = helpers.FakeRuntime(daemon.cfg.server.socket).connect()
    rt.send(helpers.make_window(helpers.hot_load(), pmap, 4, start_time=1000.0))
    group = helpers.wait_group(daemon)
    assert helpers.wait_for(lambda: len(group.history) == 1)
    rt.close()
    assert helpers.wait_for(lambda: not group.connected)
    assert helpers.wait_for(lambda: daemon.metrics.get("moewatch_runtime_connected", ("m", "g")) == 0)
    # A restarted runtime: its clock and epochs start again; the agent follows.
    rt2 = helpers.FakeRuntime(daemon.cfg.server.socket).connect()
    rt2.send(helpers.make_window(helpers.hot_load(), pmap, 4, start_time=500.0))
    assert helpers.wait_for(lambda: len(group.history) == 2)
    assert group.connected and daemon.metrics.get("moewatch_runtime_connected", ("m", "g")) == 1
    # A second hello for the same group replaces the first connection.
    rt3 = helpers.FakeRuntime(daemon.cfg.server.socket).connect()
    assert rt2.closed_by_peer()
    rt3.send(helpers.make_window(helpers.hot_load(), pmap, 4, start_time=600.0))
    ok = helpers.wait_for(lambda: len(group.history) == 3)
    print(daemon.metrics.series("moewatch_frames_rejected_total"), len(group.history))
    assert ok


def test_heartbeat_counts_runtime_drops(start_agent, helpers):
    daemon = start_agent()
    rt = helpers.FakeRuntime(daemon.cfg.server.socket).connect()
    rt.send(wire.Heartbeat(time=1.0, epoch=0, step=10, frames_dropped=3))
    rt.send(wire.Heartbeat(time=2.0, epoch=0, step=20, frames_dropped=5))
    assert helpers.wait_for(lambda: daemon.metrics.get("moewatch_runtime_frames_dropped_total", ("m", "g")) == 5)
    assert daemon.metrics.get("moewatch_frames_received_total", ("heartbeat",)) == 2


def test_stale_socket_file_is_replaced(short_tmp, start_agent):
    import socket as socketlib

    path = short_tmp / "agent.sock"
    leftover = socketlib.socket(socketlib.AF_UNIX)
    leftover.bind(str(path))
    leftover.close()  # bound, never listening: what a crash leaves behind
    daemon = start_agent()
    assert daemon.receiver.listening


def test_broken_window_helper_really_breaks_an_invariant(helpers):
    blob = helpers.make_window(helpers.hot_load(), helpers.contiguous(2, 8, 12), 4).to_bytes()
    Window.from_bytes(blob)
    try:
        Window.from_bytes(break_slot_tokens(blob))
    except WindowError as exc:
        assert exc.field in ("slot_tokens", "local_tokens", "received_tokens")
    else:
        raise AssertionError("the broken window was accepted")


def test_store_refuses_windows_while_triage_is_behind(helpers):
    from moewatch.agent.store import GroupStore

    store = GroupStore(("m", "g"), history_windows=2)
    store.on_hello(helpers.FakeRuntime("/unused").hello, connection_id=1)
    pmap = helpers.contiguous(2, 8, 12)
    windows = [helpers.make_window(helpers.hot_load(), pmap, 4, start_time=1000.0 + 10 * i) for i in range(4)]
    assert [store.accept_window(w) for w in windows[:3]] == [None, None, "backlog"]
    assert len(store.take_untriaged()) == 2
    assert store.accept_window(windows[3]) is None
