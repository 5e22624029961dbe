"""Group lifecycle as an operator meets it: a runtime restarted while its plan is verified is acted on
again, and a live runtime is never refused to keep the state of groups whose runtime left."""

from __future__ import annotations

from moewatch.agent.audit import read_audit

L, E, P, W = 2, 8, 12, 4


def rejected(daemon, reason):
    return daemon.metrics.get("moewatch_frames_rejected_total", (reason,), 0.0)


def test_at_max_groups_a_live_runtime_evicts_the_group_gone_the_longest(start_agent, helpers):
    daemon = start_agent(max_groups=64)
    for i in range(64):  # each says hello and leaves
        rt = helpers.FakeRuntime(daemon.cfg.socket, model=f"gone{i}").connect()
        group = helpers.wait_group(daemon, (f"gone{i}", "g"))
        rt.close()
        assert helpers.wait_for(lambda: not group.connected)
    assert 'model="gone0"' in helpers.scrape(daemon.http_url)
    live = helpers.FakeRuntime(daemon.cfg.socket, model="live").connect()
    group = helpers.wait_group(daemon, ("live", "g"))
    assert group.connected and rejected(daemon, "too_many_groups") == 0
    # The first to leave went, through the retirement path: state and series gone, counted, audited.
    assert daemon.store.get(("gone0", "g")) is None and daemon.store.get(("gone1", "g")) is not None
    assert len(daemon.store.groups()) == 64
    text = helpers.scrape(daemon.http_url)
    assert 'model="gone0"' not in text and 'model="gone1"' in text
    assert helpers.sample_value(text, "moewatch_groups_evicted_total") == 1
    assert helpers.sample_value(text, "moewatch_groups_retired_total") == 0
    evicted = [r for r in read_audit(daemon.cfg.audit_log) if r["event"] == "group_evicted"]
    assert [(r["model"], r["for_group"]) for r in evicted] == [("gone0", ["live", "g"])]
    # Its windows are served.
    live.send(helpers.make_window(helpers.hot_load(L, E), helpers.contiguous(L, E, P), W, model="live"))
    assert helpers.wait_for(lambda: len(group.history) == 1)
    live.close()


def test_a_limit_made_of_connected_groups_refuses(start_agent, helpers):
    daemon = start_agent(max_groups=2)
    kept = [helpers.FakeRuntime(daemon.cfg.socket, model=f"on{i}").connect() for i in range(2)]
    for i in range(2):
        helpers.wait_group(daemon, (f"on{i}", "g"))
    helpers.FakeRuntime(daemon.cfg.socket, model="third").connect()
    assert helpers.wait_for(lambda: rejected(daemon, "too_many_groups") == 1)
    assert daemon.store.get(("third", "g")) is None
    assert {g.key for g in daemon.store.groups()} == {("on0", "g"), ("on1", "g")}
    assert daemon.metrics.get("moewatch_groups_evicted_total", ()) == 0
    for rt in kept:
        rt.close()
