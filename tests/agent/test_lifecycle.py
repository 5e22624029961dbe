"""Group lifecycle as an operator meets it: a runtime restarted while its plan is verified is acted on
again, and a live runtime is never refused to keep the state of groups whose runtime left."""

from __future__ import annotations

from moewatch.agent.audit import read_audit

L, E, P, W = 2, 8, 12, 4


def rejected(daemon, reason):
    return daemon.metrics.get("moewatch_frames_rejected_total", (reason,), 0.0)


def test_at_max_groups_a_live_runtime_evicts_the_group_gone_the_longest(start_agent, helpers):
    daemon = start_agent(limits={"max_groups": 64})
    for i in range(64):  # each says hello and leaves
        rt = helpers.FakeRuntime(daemon.cfg.server.socket, model=f"gone{i}").connect()
        group = helpers.wait_group(daemon, (f"gone{i}", "g"))
        rt.close()
        assert helpers.wait_for(lambda: not group.connected)
    assert 'model="gone0"' in helpers.scrape(daemon.http_url)
    live = helpers.FakeRuntime(daemon.cfg.server.socket, model="live").connect()
    group = helpers.wait_group(daemon, ("live", "g"))
    assert group.connected and rejected(daemon, "too_many_groups") == 0
    # The first to leave went, through the retirement path: state and series gone, counted, audited.
    assert daemon.store.get(("gone0", "g")) is None and daemon.store.get(("gone1", "g")) is not None
    assert len(daemon.store.groups()) == 64
    text = helpers.scrape(daemon.http_url)
    assert 'model="gone0"' not in text and 'model="gone1"' in text
    assert helpers.sample_value(text, "moewatch_groups_evicted_total") == 1
    assert helpers.sample_value(text, "moewatch_groups_retired_total") == 0
    evicted = [r for r in read_audit(daemon.cfg.log.audit_log) if r["event"] == "group_evicted"]
    assert [(r["model"], r["for_group"]) for r in evicted] == [("gone0", ["live", "g"])]
    # Its windows are served.
    live.send(helpers.make_window(helpers.hot_load(L, E), helpers.contiguous(L, E, P), W, model="live"))
    assert helpers.wait_for(lambda: len(group.history) == 1)
    live.close()


def test_a_limit_made_of_connected_groups_refuses(start_agent, helpers):
    daemon = start_agent(limits={"max_groups": 2})
    kept = [helpers.FakeRuntime(daemon.cfg.server.socket, model=f"on{i}").connect() for i in range(2)]
    for i in range(2):
        helpers.wait_group(daemon, (f"on{i}", "g"))
    helpers.FakeRuntime(daemon.cfg.server.socket, model="third").connect()
    assert helpers.wait_for(lambda: rejected(daemon, "too_many_groups") == 1)
    assert daemon.store.get(("third", "g")) is None
    assert {g.key for g in daemon.store.groups()} == {("on0", "g"), ("on1", "g")}
    assert daemon.metrics.get("moewatch_groups_evicted_total", ()) == 0
    for rt in kept:
        rt.close()


def test_a_restarted_runtime_is_decided_on_and_acted_on_when_the_old_ones_ack_arrives_late(start_agent, helpers):
    """The old runtime answers its plan and dies; its Ack is still queued (the controller was busy)
    when the new runtime says hello at epoch 0. The old lineage's Ack must not raise the new one's
    fence: else every window of the restarted runtime is stale and the group is never decided on."""
    import dataclasses

    from moewatch import wire

    daemon = start_agent(policy={"mode": "act", "persist_windows": 4, "cooldown_seconds": 8}, verify={"windows": 5})

    def runtime(pid):
        rt = helpers.FakeRuntime(daemon.cfg.server.socket)
        rt.hello = dataclasses.replace(rt.hello, pid=pid)
        return rt.connect()

    def feed(rt, n, start):
        for i in range(n):
            rt.send(helpers.make_window(helpers.hot_load(L, E), helpers.contiguous(L, E, P), W,
                                        start_time=start + 10 * i))

    old = runtime(100)
    group = helpers.wait_group(daemon)
    feed(old, 4, 1000.0)
    assert helpers.wait_for(lambda: len(group.history) == 4)
    daemon.plan_job()
    plan = old.wait_plan()
    assert plan is not None
    with daemon.controller._lock:  # a planning run elsewhere holds the controller
        old.send(wire.Ack(plan_epoch=plan.epoch, epoch_in_force=plan.epoch, ok=True))
        # Read before the new hello; its handling waits for the controller.
        assert helpers.wait_for(lambda: daemon.metrics.get("moewatch_frames_received_total", ("ack",)) == 1)
        old.close()
        assert helpers.wait_for(lambda: not group.connected)
        new = runtime(200)
        assert helpers.wait_for(lambda: group.lineage == 1)  # hello handled; abandoning waits too
    # The restarted runtime is observed, decided on and acted on like a new one.
    feed(new, 4, 5000.0)
    assert helpers.wait_for(lambda: len(group.recent(epoch=0)) == 4 and group.epoch_in_force == 0), \
        (group.epoch_in_force, rejected(daemon, "stale_epoch"))
    assert rejected(daemon, "stale_epoch") == 1  # the old runtime's Ack, none of the new one's windows
    daemon.plan_job()
    again = new.wait_plan()
    assert again is not None and again.epoch > plan.epoch
    decisions = [r for r in read_audit(daemon.cfg.log.audit_log) if r["event"] == "decision"]
    assert len(decisions) == 4  # two layers, twice
    new.close()


def test_frames_of_a_replaced_connection_never_move_the_new_runtimes_fence(start_agent, helpers):
    """A restarted runtime takes its group over while the old connection still has frames read (in the
    same read as it is closed): an old window at the plan's epoch must not fence the new one out."""
    import dataclasses

    from moewatch import wire

    daemon = start_agent(policy={"mode": "act"})
    old = helpers.FakeRuntime(daemon.cfg.server.socket)
    old.hello = dataclasses.replace(old.hello, pid=100)
    old.connect()
    group = helpers.wait_group(daemon)
    old_conn = daemon.connection_of(group.key)
    for i in range(2):
        old.send(helpers.make_window(helpers.hot_load(L, E), helpers.contiguous(L, E, P), W, start_time=1000.0 + i))
    assert helpers.wait_for(lambda: len(group.history) == 2)
    daemon.plan_job()
    plan = old.wait_plan()
    old.send(wire.Ack(plan_epoch=plan.epoch, epoch_in_force=plan.epoch, ok=True))
    assert helpers.wait_for(lambda: group.epoch_in_force == plan.epoch)
    new = helpers.FakeRuntime(daemon.cfg.server.socket)
    new.hello = dataclasses.replace(new.hello, pid=200)
    new.connect()
    assert helpers.wait_for(lambda: group.lineage == 1 and group.connection_id != old_conn.id)
    late = helpers.make_window(helpers.hot_load(L, E), plan.physical_to_logical_map, W, epoch=plan.epoch,
                               start_time=3000.0)
    assert daemon.handle_message(old_conn, late) == "replaced"
    assert group.epoch_in_force == 0
    for i in range(2):
        new.send(helpers.make_window(helpers.hot_load(L, E), helpers.contiguous(L, E, P), W, start_time=4000.0 + i))
    assert helpers.wait_for(lambda: len(group.recent(epoch=0)) == 2)
    daemon.plan_job()
    again = new.wait_plan()
    assert again is not None and again.epoch > plan.epoch
    old.close()
    new.close()


def test_a_window_taken_for_triage_before_a_restart_never_counts_for_the_new_runtime(helpers):
    import dataclasses

    from moewatch.agent.store import GroupStore, TriagedWindow
    from moewatch.triage import diagnose
    from moewatch.thresholds import Thresholds
    from moewatch.wire import Hello

    group = GroupStore(("m", "g"), history_windows=8)
    hello = Hello(runtime="fake", model="m", ep_group="g", world_size=W, num_layers=L, num_experts=E, num_slots=P,
                  pid=100)
    group.on_hello(hello, 1)
    window = helpers.make_window(helpers.hot_load(L, E), helpers.contiguous(L, E, P), W)
    assert group.accept_window(window) is None
    (taken,) = group.take_untriaged()  # the triage job is under way with it...
    assert group.on_hello(dataclasses.replace(hello, pid=200), 2)  # ...when the restarted runtime says hello
    triaged = TriagedWindow(taken, diagnose(taken, Thresholds()), 0.0)
    assert group.add_triaged(triaged) is False
    assert group.recent() == []
    fresh = helpers.make_window(helpers.hot_load(L, E), helpers.contiguous(L, E, P), W, start_time=2000.0)
    assert group.accept_window(fresh) is None
    assert group.add_triaged(TriagedWindow(fresh, diagnose(fresh, Thresholds()), 0.0)) is True
    assert [t.window for t in group.recent()] == [fresh]
