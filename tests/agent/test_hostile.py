"""The agent under hostile or broken peers (issue 11): impossible hellos, idle and slow connections,
byte budgets, runtimes that do not read, restarts mid-verification, groups that leave, a second
agent on the same socket, a planted audit-log symlink, log floods. Each test names the defect."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import stat
import struct
import threading

import numpy as np
import pytest

from moewatch import wire
from moewatch.agent.audit import AuditLog, read_audit
from moewatch.agent.config import AgentConfig, build_config
from moewatch.agent.daemon import Daemon, StartupError
from moewatch.plan import Plan

L, E, P, W = 2, 8, 12, 4


def rejected(daemon, reason):
    return daemon.metrics.get("moewatch_frames_rejected_total", (reason,), 0.0)


def feed(rt, helpers, n, start, epoch=0, pmap=None):
    pmap = helpers.contiguous(L, E, P) if pmap is None else pmap
    for i in range(n):
        rt.send(helpers.make_window(helpers.hot_load(L, E), pmap, W, start_time=start + 10 * i, epoch=epoch,
                                   model=rt.hello.model))


def runtime(helpers, daemon, pid=0, epoch=0, **kw):
    rt = helpers.FakeRuntime(daemon.cfg.server.socket, epoch=epoch, **kw)
    rt.hello = dataclasses.replace(rt.hello, pid=pid)
    return rt


# --- Build 3: hello and window validation; one group's failure stops nobody else ----------------------

@pytest.mark.parametrize("sizes,reason", [
    ({"world_size": 0}, "invalid_hello"),
    ({"world_size": 2 ** 40, "num_slots": 2 ** 40}, "hello_over_limit"),
    ({"num_slots": 6}, "invalid_hello"),  # fewer slots than experts
    ({"num_experts": 16, "num_slots": 16}, "hello_over_limit"),  # above max_num_experts=8 below
])
def test_impossible_or_oversized_hello_is_rejected_with_a_reason(start_agent, helpers, sizes, reason):
    # The configured limit only where the case needs it: the others fail on an agent without limits.
    daemon = start_agent(**({"limits": {"max_num_experts": 8}} if "num_experts" in sizes else {}))
    rt = helpers.FakeRuntime(daemon.cfg.server.socket, **sizes)
    rt.connect()
    assert helpers.wait_for(lambda: rejected(daemon, reason) == 1)
    assert daemon.store.get(("m", "g")) is None


def test_top_k_above_num_experts_is_invalid_window_not_oversized(start_agent, helpers):
    daemon = start_agent()
    rt = helpers.FakeRuntime(daemon.cfg.server.socket).connect()
    helpers.wait_group(daemon)
    blob = helpers.make_window(helpers.hot_load(L, E), helpers.contiguous(L, E, P), W).to_bytes()
    blob = blob.replace(b'"top_k":2,', b'"top_k":9,')  # the same length: only the header changes
    rt.send_raw(wire.HEADER.pack(wire.MAGIC, wire.PROTOCOL_VERSION, int(wire.FrameType.WINDOW), len(blob)) + blob)
    assert helpers.wait_for(lambda: rejected(daemon, "invalid_window") == 1)
    assert rejected(daemon, "oversized") == 0


def test_a_group_whose_plan_job_fails_does_not_stop_the_others(start_agent, helpers):
    daemon = start_agent(policy={"mode": "recommend"})
    # A group whose state breaks the planner (as a zero world_size did before hellos were checked),
    # put in the store directly: the hello gate would refuse it now.
    broken = daemon.store.get_or_create(("broken", "g"))
    broken.on_hello(wire.Hello(runtime="x", model="broken", ep_group="g", world_size=0, num_layers=L,
                               num_experts=E, num_slots=P), connection_id=-1)
    rt = helpers.FakeRuntime(daemon.cfg.server.socket).connect()
    group = helpers.wait_group(daemon)
    feed(rt, helpers, 3, 1000.0)
    assert helpers.wait_for(lambda: len(group.history) == 3)
    # The broken group comes first in the store; the good one is still decided.
    broken.history.extend(group.history)
    daemon.plan_job()
    assert daemon.metrics.get("moewatch_job_errors_total", ("plan",)) >= 1
    events = [r for r in read_audit(daemon.cfg.log.audit_log) if r["event"] == "decision"]
    assert any(r["model"] == "m" for r in events)


# --- Build 2: no thread per client, limits, deadlines, budgets, sends that never block -------------

@pytest.mark.slow
def test_idle_connections_cost_no_threads_and_the_limit_refuses_and_counts(start_agent, helpers):
    daemon = start_agent(limits={"max_connections": 150, "max_groups": 200})
    # Threads other than the scheduler's pool (it grows with the jobs' work, here 150 groups, not with peers).
    threads = lambda: sum(not t.name.startswith("ThreadPoolExecutor") for t in threading.enumerate())  # noqa: E731
    before = threads()
    socks = []
    for i in range(200):  # each says hello (a silent one would give way to the next: test_peer_limits.py)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(daemon.cfg.server.socket)
        try:
            s.sendall(wire.encode(wire.Hello(runtime="idle", model=f"idle{i}", ep_group="g", world_size=W,
                                             num_layers=L, num_experts=E, num_slots=P)))
        except OSError:
            pass  # refused at the limit
        socks.append(s)
        if i == 149:  # the limit is full of peers that said hello
            assert helpers.wait_for(lambda: len(daemon.store.groups()) == 150)
    try:
        refused = lambda: daemon.metrics.get("moewatch_connections_refused_total", ("max_connections",))  # noqa: E731
        assert helpers.wait_for(lambda: refused() == 50)
        assert len(daemon.receiver.connections()) == 150
        assert threads() <= before + 1
        # A runtime still gets in once others leave, and is served.
        for s in socks[:10]:
            s.close()
        assert helpers.wait_for(lambda: len(daemon.receiver.connections()) == 140)
        rt = helpers.FakeRuntime(daemon.cfg.server.socket, model="late").connect()
        helpers.wait_group(daemon, ("late", "g"))
        rt.close()
    finally:
        for s in socks:
            s.close()


def test_a_frame_that_stalls_is_cut_at_the_deadline(start_agent, helpers):
    daemon = start_agent(limits={"frame_deadline_seconds": 0.3})
    slow = helpers.FakeRuntime(daemon.cfg.server.socket).connect()
    slow.send_raw(wire.HEADER.pack(wire.MAGIC, wire.PROTOCOL_VERSION, int(wire.FrameType.HEARTBEAT), 1000) + b"{")
    assert helpers.wait_for(lambda: rejected(daemon, "frame_deadline") == 1)
    assert slow.closed_by_peer()
    assert daemon.metrics.get("moewatch_connections_closed_total", ("frame_deadline",)) == 1


def test_partial_frames_across_connections_stay_within_the_byte_budget(start_agent, helpers):
    daemon = start_agent(limits={"max_frame_bytes": 1 << 20, "buffer_budget_bytes": 2 << 20})
    header = wire.HEADER.pack(wire.MAGIC, wire.PROTOCOL_VERSION, int(wire.FrameType.WINDOW), (1 << 20) - 1)
    peers = []
    for _ in range(4):  # each declares a 1 MiB frame and sends 700 KiB of it
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(daemon.cfg.server.socket)
        try:
            s.sendall(header + b"\0" * (700 << 10))
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed by the agent for going over the budget
        peers.append(s)
    assert helpers.wait_for(lambda: rejected(daemon, "buffer_budget") >= 2)
    assert daemon.receiver._buffered_bytes() <= 2 << 20
    assert helpers.wait_for(lambda: len(daemon.receiver.connections()) == 4 - rejected(daemon, "buffer_budget"))
    assert helpers.wait_for(lambda: daemon.metrics.get("moewatch_connections_closed_total", ("buffer_budget",))
                            == rejected(daemon, "buffer_budget"))
    for s in peers:
        s.close()


def test_a_runtime_that_does_not_read_is_disconnected_and_never_blocks_the_agent(start_agent, helpers):
    daemon = start_agent(limits={"max_outbox_bytes": 64 << 10})
    deaf = helpers.FakeRuntime(daemon.cfg.server.socket).connect()
    deaf.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    helpers.wait_group(daemon)
    conn = daemon.connection_of(("m", "g"))
    plan = Plan(1, helpers.contiguous(L, E, P), np.zeros(L), "x" * 30_000, {})
    with pytest.raises(ConnectionError):
        for _ in range(10_000):  # a blocking send would hang here once the socket buffers fill
            conn.send(plan)
    assert helpers.wait_for(
        lambda: daemon.metrics.get("moewatch_connections_closed_total", ("slow_reader",)) == 1)
    assert helpers.wait_for(lambda: not daemon.store.get(("m", "g")).connected)
    # Another group is served all along.
    other = helpers.FakeRuntime(daemon.cfg.server.socket, model="other").connect()
    group = helpers.wait_group(daemon, ("other", "g"))
    feed(other, helpers, 1, 1000.0)
    assert helpers.wait_for(lambda: len(group.history) == 1)
    deaf.close()


def test_tcp_listener_speaks_the_same_frames(start_agent, helpers):
    daemon = start_agent(server={"tcp_listen": "127.0.0.1:0"})
    s = socket.create_connection(("127.0.0.1", daemon.receiver.tcp_port), timeout=5)
    hello = wire.Hello(runtime="tcp", model="m", ep_group="g", world_size=W, num_layers=L, num_experts=E,
                       num_slots=P, ranks_per_node=W)
    s.sendall(wire.encode(hello))
    group = helpers.wait_group(daemon)
    s.sendall(wire.encode(helpers.make_window(helpers.hot_load(L, E), helpers.contiguous(L, E, P), W)))
    assert helpers.wait_for(lambda: len(group.history) == 1)
    # Plans go back over TCP too.
    daemon.controller.submit(group, helpers.contiguous(L, E, P)[:, ::-1].copy(), np.zeros(L), "tcp test")
    decoder = wire.FrameDecoder()
    s.settimeout(5)
    items = []
    while not items:
        items = decoder.feed(s.recv(1 << 16))
    assert isinstance(items[0], Plan) and items[0].epoch == 1
    s.close()


def test_tcp_listen_is_loopback_unless_named_and_validated_at_the_edge():
    from moewatch.thresholds import ConfigError

    assert build_config(environ={}, flags={"server.tcp_listen": "7071"}).server.tcp_listen == "127.0.0.1:7071"
    assert build_config(environ={}).server.tcp_listen == ""
    with pytest.raises(ConfigError, match="^server.tcp_listen: port 'x' is not a number"):
        build_config(environ={}, flags={"server.tcp_listen": "127.0.0.1:x"})


# --- Build 4: group lifecycle -----------------------------------------------------------------------

def test_groups_whose_runtime_left_are_retired_and_their_series_removed(start_agent, helpers):
    daemon = start_agent(limits={"group_retire_seconds": 0.3, "max_groups": 1})
    rt = helpers.FakeRuntime(daemon.cfg.server.socket, model="gone").connect()
    group = helpers.wait_group(daemon, ("gone", "g"))
    feed(rt, helpers, 1, 1000.0)
    assert helpers.wait_for(lambda: len(group.history) == 1)
    assert 'model="gone"' in helpers.scrape(daemon.http_url)
    rt.close()
    assert helpers.wait_for(lambda: daemon.store.get(("gone", "g")) is None)
    assert 'model="gone"' not in helpers.scrape(daemon.http_url)
    assert daemon.metrics.get("moewatch_groups_retired_total", ()) == 1
    # The slot is free again: a new group is not refused as too_many_groups.
    helpers.FakeRuntime(daemon.cfg.server.socket, model="new").connect()
    helpers.wait_group(daemon, ("new", "g"))
    assert rejected(daemon, "too_many_groups") == 0
    assert "group_retired" in [r["event"] for r in read_audit(daemon.cfg.log.audit_log)]


def test_a_runtime_restarted_during_verification_gets_a_new_lineage_and_the_policy_acts_again(start_agent, helpers):
    daemon = start_agent(policy={"mode": "act"}, verify={"windows": 3})
    old = runtime(helpers, daemon, pid=100).connect()
    group = helpers.wait_group(daemon)
    feed(old, helpers, 2, 1000.0)
    assert helpers.wait_for(lambda: len(group.history) == 2)
    daemon.plan_job()
    plan = old.wait_plan()
    assert plan is not None
    old.send(wire.Ack(plan_epoch=plan.epoch, epoch_in_force=plan.epoch, ok=True))
    assert helpers.wait_for(lambda: daemon.controller.control(group.key).verifying is not None)
    old.close()  # dies while the agent verifies
    assert helpers.wait_for(lambda: not group.connected)
    new = runtime(helpers, daemon, pid=200, epoch=0).connect()
    assert helpers.wait_for(lambda: daemon.controller.control(group.key).verifying is None)
    abandoned = [r for r in read_audit(daemon.cfg.log.audit_log) if r["event"] == "plan_abandoned"]
    assert len(abandoned) == 1 and abandoned[0]["epoch"] == plan.epoch
    # The old lineage's windows do not count: one window of the new runtime is not K=2 of them.
    feed(new, helpers, 1, 2000.0)
    assert helpers.wait_for(lambda: len(group.history) == 1)
    daemon.plan_job()
    assert new.wait_plan(timeout=0.5) is None
    feed(new, helpers, 1, 2100.0)
    assert helpers.wait_for(lambda: len(group.history) == 2)
    daemon.plan_job()
    again = new.wait_plan()
    assert again is not None and again.epoch > plan.epoch


def test_reconnects_do_not_inflate_the_runtime_dropped_frames(start_agent, helpers):
    daemon = start_agent()
    dropped = lambda: daemon.metrics.get("moewatch_runtime_frames_dropped_total", ("m", "g"))  # noqa: E731
    rt = runtime(helpers, daemon, pid=7).connect()
    rt.send(wire.Heartbeat(time=1.0, epoch=0, step=1, frames_dropped=5))
    assert helpers.wait_for(lambda: dropped() == 5)
    for total in (5, 9):  # the same process reconnects twice; its cumulative count is 5, then 9
        rt.close()
        rt = runtime(helpers, daemon, pid=7).connect()
        rt.send(wire.Heartbeat(time=2.0, epoch=0, step=2, frames_dropped=total))
        assert helpers.wait_for(lambda: daemon.metrics.get("moewatch_frames_received_total", ("heartbeat",)) >= 2)
    assert helpers.wait_for(lambda: dropped() == 9)
    rt.close()
    # Another process starts its own count from zero.
    rt = runtime(helpers, daemon, pid=8).connect()
    rt.send(wire.Heartbeat(time=3.0, epoch=0, step=1, frames_dropped=2))
    assert helpers.wait_for(lambda: dropped() == 11)
    rt.close()


# --- Build 5: socket ownership and the audit log -------------------------------------------------

def test_a_second_agent_on_the_same_socket_refuses_and_leaves_the_live_one_alone(start_agent, helpers, short_tmp):
    first = start_agent()
    second = Daemon(AgentConfig.from_mapping({"server": {"socket": first.cfg.server.socket, "listen": "127.0.0.1:0"},
                                              "log": {"audit_log": str(short_tmp / "audit2.jsonl")}}))
    with pytest.raises(StartupError, match="another process is listening"):
        second.start()
    second.stop(quiet=True)
    assert stat.S_ISSOCK(os.lstat(first.cfg.server.socket).st_mode)
    helpers.FakeRuntime(first.cfg.server.socket).connect()
    helpers.wait_group(first)


def test_audit_log_refuses_a_symlink_and_resets_a_wide_mode(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("")
    link = tmp_path / "audit.jsonl"
    link.symlink_to(victim)
    with pytest.raises(OSError):
        AuditLog(link)
    assert victim.read_text() == ""
    wide = tmp_path / "wide.jsonl"
    wide.write_text("")
    os.chmod(wide, 0o666)
    AuditLog(wide).close()
    assert stat.S_IMODE(os.stat(wide).st_mode) == 0o640
    fresh = tmp_path / "fresh.jsonl"
    old_umask = os.umask(0o077)
    try:
        AuditLog(fresh).close()
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o640


# --- Logs under attack --------------------------------------------------------------------------------

def test_a_flood_of_bad_frames_is_counted_but_logged_once_per_reason(start_agent, helpers, caplog):
    daemon = start_agent(log={"interval_seconds": 3600})
    rt = helpers.FakeRuntime(daemon.cfg.server.socket).connect()
    helpers.wait_group(daemon)
    bad = b"MW\x01\x05\x02\x00\x00\x00{]"
    with caplog.at_level(logging.INFO, logger="moewatch.agent"):
        rt.send_raw(bad * 300)
        assert helpers.wait_for(lambda: rejected(daemon, "malformed") == 300)
    lines = [r for r in caplog.records if "frame rejected (malformed)" in r.getMessage()]
    assert len(lines) == 1


def test_a_reconnect_loop_is_logged_once_per_kind_with_a_tally(start_agent, helpers, caplog):
    # A peer reconnecting in a loop (or many hostile ones) gave a connect, replace and disconnect line
    # each time: about 5,100 lines under a fuzz load. Now one per kind per log interval.
    daemon = start_agent(log={"interval_seconds": 3600})
    with caplog.at_level(logging.INFO, logger="moewatch.agent"):
        held = [helpers.FakeRuntime(daemon.cfg.server.socket).connect() for _ in range(2)]  # the 2nd replaces
        assert held[0].closed_by_peer()  # replaced by the 2nd
        for _ in range(10):  # connect, then leave: each is the group's runtime, then disconnects
            before = daemon.connection_of(("m", "g"))
            rt = helpers.FakeRuntime(daemon.cfg.server.socket).connect()
            assert helpers.wait_for(lambda: daemon.connection_of(("m", "g")) not in (None, before))
            rt.close()
            assert helpers.wait_for(lambda: daemon.connection_of(("m", "g")) is None)
        for rt in held:
            rt.close()

    def lines(text):
        return [r.getMessage() for r in caplog.records if text in r.getMessage()]

    assert len(lines(") connected: m/g")) == 1
    assert len(lines("replaces")) == 1
    assert len(lines("runtime of m/g disconnected")) == 1


def test_a_throttled_line_after_held_ones_says_how_many(caplog):
    from moewatch.agent.throttle import Throttle

    now = [0.0]
    throttle = Throttle(10.0, clock=lambda: now[0])
    logger = logging.getLogger("moewatch.agent.test")
    with caplog.at_level(logging.INFO, logger="moewatch.agent.test"):
        for t in (0.0, 1.0, 2.0, 10.5, 11.0):
            now[0] = t
            throttle.log(logger, logging.INFO, "connect", "runtime %s connected", "r")
    assert [r.getMessage() for r in caplog.records] == [
        "runtime r connected", "runtime r connected (2 more like this since the last line)"]


def test_skipped_scheduler_runs_log_one_line_per_interval(caplog):
    import time

    from moewatch.agent.jobs import Jobs

    misfires = []
    jobs = Jobs(on_error=lambda j: None, on_misfire=misfires.append, log_interval=3600)
    done = threading.Event()

    def slow():
        time.sleep(0.4)
        done.set()

    jobs.add("slow", slow, 0.05, first_run_in=0)
    with caplog.at_level(logging.DEBUG):
        jobs.start()
        try:
            assert done.wait(5)
            while len(misfires) < 3:
                time.sleep(0.05)
        finally:
            jobs.shutdown()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(misfires) >= 3
    assert len(warnings) == 1 and warnings[0].name == "moewatch.agent.jobs"
