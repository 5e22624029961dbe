"""The reconcile loop against a fake runtime: act sends a plan and follows its Ack, verification rolls a
bad plan back with a new epoch, observe never sends, recommend records; the SGLang actuator."""

from __future__ import annotations

import json

import numpy as np

from moewatch import wire
from moewatch.agent.audit import read_audit
from moewatch.integrations.sglang.actuator import SGLangActuator
from moewatch.planner import placement_math as pm
from moewatch.plan import Plan

L, E, P, W = 2, 8, 12, 4


def feed(rt, helpers, load, pmap, n, start, epoch=0):
    for i in range(n):
        rt.send(helpers.make_window(load, pmap, W, start_time=start + 10 * i, epoch=epoch))


def hot_group(start_agent, helpers, windows=2, **settings):
    """An agent with a fake runtime whose group has seen `windows` windows with a hot expert 0 on the
    contiguous placement: (daemon, runtime, group, load, placement)."""
    daemon = start_agent(**settings)
    rt = helpers.FakeRuntime(daemon.cfg.server.socket).connect()
    group = helpers.wait_group(daemon)
    load, old = helpers.hot_load(L, E), helpers.contiguous(L, E, P)
    feed(rt, helpers, load, old, windows, 1000.0)
    assert helpers.wait_for(lambda: len(group.history) == windows)
    return daemon, rt, group, load, old


def test_act_replicates_acks_verifies_and_audits(start_agent, helpers):
    daemon, rt, group, load, old = hot_group(start_agent, helpers, policy={"mode": "act"}, verify={"windows": 2})
    assert all(d.verdict == "imbalance-bound" and d.cause == "hot-experts" for d in group.latest().diagnosis.layers)
    daemon.controller.plan_tick()
    plan = rt.wait_plan()
    assert plan is not None and plan.epoch == 1
    assert (pm.replica_counts_of(plan.physical_to_logical_map, E)[:, 0] > 1).all()
    # Windows of the old epoch after the Ack are fenced out; the new epoch's are verified.
    rt.send(wire.Ack(plan_epoch=1, epoch_in_force=1, ok=True, step=10, stall_seconds=0.01, layers_changed=2))
    assert helpers.wait_for(lambda: daemon.controller.control(group.key).verifying is not None)
    feed(rt, helpers, load, old, 1, 1100.0, epoch=0)
    feed(rt, helpers, load, plan.physical_to_logical_map, 3, 1200.0, epoch=1)  # MIN_VERIFY_WINDOWS
    assert helpers.wait_for(lambda: daemon.controller.control(group.key).verifying is None)
    assert daemon.metrics.get("moewatch_frames_rejected_total", ("stale_epoch",)) == 1
    after = np.mean([d.metrics["balancedness"] for d in group.latest().diagnosis.layers])
    before = np.mean([d.metrics["balancedness"] for d in group.recent(epoch=0)[-1].diagnosis.layers])
    assert after > before + 0.1
    assert daemon.metrics.get("moewatch_actions_total", ("m", "g", "replicate", "applied")) == 2
    events = [r["event"] for r in read_audit(daemon.cfg.log.audit_log)]
    assert events[:4] == ["decision", "decision", "plan_sent", "plan_applied"]
    assert "verified" in events
    sent = next(r for r in read_audit(daemon.cfg.log.audit_log) if r["event"] == "plan_sent")
    assert sent["epoch"] == 1 and sent["kinds"] == ["replicate"]
    decision = next(r for r in read_audit(daemon.cfg.log.audit_log) if r["event"] == "decision")
    assert decision["before"]["model_balancedness"] < decision["after"]["model_balancedness"]
    text = helpers.scrape(daemon.http_url)
    assert helpers.sample_value(text, "moewatch_actions_total", kind="replicate", result="applied") == 2
    assert helpers.sample_value(text, "moewatch_epoch", model="m", ep_group="g") == 1


def test_bad_plan_is_rolled_back_with_a_new_epoch(start_agent, helpers):
    daemon, rt, group, load, old = hot_group(start_agent, helpers, policy={"mode": "act"}, verify={"windows": 2})
    bad = old.copy()
    bad[0] = [0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 1, 2]  # three replicas of the hot expert on one GPU
    sent = daemon.controller.submit(group, bad, np.zeros(L), "operator plan for the test")
    assert sent is not None and sent.epoch == 1
    assert rt.wait_plan().epoch == 1
    rt.send(wire.Ack(plan_epoch=1, epoch_in_force=1, ok=True))
    assert helpers.wait_for(lambda: daemon.controller.control(group.key).verifying is not None)
    feed(rt, helpers, load, bad, 3, 1200.0, epoch=1)  # MIN_VERIFY_WINDOWS
    rollback = rt.wait_plan()
    assert rollback is not None and rollback.epoch == 2 and rollback.meta["rollback_of"] == 1
    assert np.array_equal(rollback.physical_to_logical_map, old)
    rt.send(wire.Ack(plan_epoch=2, epoch_in_force=2, ok=True))
    assert helpers.wait_for(lambda: daemon.metrics.get("moewatch_rollbacks_total", ("m", "g")) == 1)
    assert daemon.metrics.get("moewatch_actions_total", ("m", "g", "placement", "rolled_back")) == 1
    records = read_audit(daemon.cfg.log.audit_log)
    rb = next(r for r in records if r["event"] == "rollback")
    assert rb["layers"] == [0] and "old placement" in rb["reason"]
    assert rb["numbers"]["0"]["balancedness_after"] < rb["numbers"]["0"]["balancedness_old_map_same_load"]
    assert [r["event"] for r in records][-1] == "rolled_back"


def test_refused_plan_counts_as_failed(start_agent, helpers):
    daemon, rt, group, _, _ = hot_group(start_agent, helpers, policy={"mode": "act"})
    daemon.controller.plan_tick()
    plan = rt.wait_plan()
    rt.send(wire.Ack(plan_epoch=plan.epoch, epoch_in_force=0, ok=False, error="migration failed on rank 2"))
    assert helpers.wait_for(lambda: daemon.metrics.get("moewatch_actions_total", ("m", "g", "replicate", "failed")) == 2)
    assert daemon.controller.control(group.key).in_flight is None
    failed = next(r for r in read_audit(daemon.cfg.log.audit_log) if r["event"] == "plan_failed")
    assert "rank 2" in failed["error"]


def test_observe_mode_never_sends_a_plan(start_agent, helpers):
    daemon, rt, group, _, _ = hot_group(start_agent, helpers, windows=4, policy={"mode": "observe"},
                                        jobs={"plan_interval_seconds": 0.1})
    daemon.controller.plan_tick()
    assert rt.recv(timeout=1.0) == []
    assert all(d.verdict == "imbalance-bound" for d in group.latest().diagnosis.layers)
    assert not [r for r in read_audit(daemon.cfg.log.audit_log) if r["event"] == "plan_sent"]


def test_recommend_mode_records_without_sending(start_agent, helpers):
    daemon, rt, group, _, _ = hot_group(start_agent, helpers, policy={"mode": "recommend"})
    daemon.controller.plan_tick()
    assert rt.recv(timeout=0.5) == []
    assert daemon.metrics.get("moewatch_actions_total", ("m", "g", "replicate", "recommended")) == 2
    assert {r["result"] for r in read_audit(daemon.cfg.log.audit_log) if r["event"] == "decision"} == {"recommended"}


def test_sglang_actuator_writes_location_and_runs_command(short_tmp, helpers):
    location = short_tmp / "sglang" / "expert_location.json"
    marker = short_tmp / "ran"
    pmap = np.tile(np.arange(12) % 8, (2, 1))
    plan = Plan(3, pmap, np.zeros(2), "test")
    settings = helpers.sglang_settings(location_file=str(location),
                                       command=f"sh -c 'echo $MOEWATCH_PLAN_EPOCH > {marker}'")
    ok = SGLangActuator(settings).apply(("m", "g"), plan)
    assert ok.status == "applied" and ok.ack.ok and ok.ack.epoch_in_force == 3
    assert json.loads(location.read_text()) == {"physical_to_logical_map": pmap.tolist()}
    assert marker.read_text().strip() == "3"
    failed = SGLangActuator(helpers.sglang_settings(location_file=str(location),
                                                    command="sh -c 'echo nope >&2; exit 4'")).apply(("m", "g"), plan)
    assert failed.status == "failed" and not failed.ack.ok and "exited 4: nope" in failed.detail
