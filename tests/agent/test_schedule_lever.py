"""The all-to-all order as a policy lever (agent/policy.py schedule_proposals, the controller's Plan
field, verification and rollback): a comm-bound / volume layer far above its bound gets a plan that sets
Aurora's order; without the bound in the windows, or without the runtime's capability, it does not; a
rollback puts the previous order back."""

from __future__ import annotations

import numpy as np

from moewatch import telemetry as tm
from moewatch.agent import policy
from moewatch.agent.config import AgentConfig
from moewatch.agent.params import from_config
from moewatch.agent.store import TriagedWindow
from moewatch.triage import diagnose

W, L, E, P = 4, 2, 8, 8


def _windows(helpers, n, over_bound: float | None, start=1000.0):
    load = np.full((L, E), 400)
    pmap = helpers.contiguous(L, E, P)
    out = []
    for i in range(n):
        w = helpers.make_window(load, pmap, W, start_time=start + 10 * i, transfer_seconds=0.05)
        if over_bound is not None:
            a2a = w.dispatch_seconds + w.combine_seconds
            bound = a2a.max(axis=1) / over_bound
            w = w.replace(a2a_bound_seconds=bound, a2a_over_bound=tm.a2a_over_bound(a2a, bound))
        out.append(TriagedWindow(w, diagnose(w), 0.0))
    return out


def _view(windows, capabilities=("plan", "capacity", "schedule"), **changes):
    return policy.GroupView(num_gpus=W, num_nodes=1, num_experts=E, num_slots=P,
                            capabilities=frozenset(capabilities), windows=windows, **changes)


def _params():
    return from_config(AgentConfig.from_mapping({"policy": {"mode": "act", "persist_windows": 3}})).policy


def test_far_above_the_bound_the_plan_sets_aurora(helpers):
    windows = _windows(helpers, 3, over_bound=3.0)
    assert {(d.verdict, d.cause) for d in windows[-1].diagnosis.layers} == {("comm-bound", "volume")}
    proposal = policy.decide(_view(windows), _params(), now=0.0)
    assert proposal.has_plan and proposal.a2a_schedule == "aurora"
    schedule = [d for d in proposal.decisions if d.kind == "schedule"]
    assert {d.layers[0] for d in schedule} == {0, 1} and all(d.result == "proposed" for d in schedule)
    assert all(d.after["predicted_gain"] > 0 for d in schedule)
    assert set(proposal.changed_layers) >= {0, 1} and set(proposal.baseline) >= {0, 1}  # verified like the others


def test_no_bound_no_capability_or_already_on_no_schedule(helpers):
    assert policy.decide(_view(_windows(helpers, 3, over_bound=None)), _params(), 0.0).a2a_schedule is None
    windows = _windows(helpers, 3, over_bound=3.0)
    refused = policy.decide(_view(windows, capabilities=("plan", "capacity")), _params(), 0.0)
    assert refused.a2a_schedule is None
    assert any(d.kind == "schedule" and d.result == "skipped" and "order" in d.reason for d in refused.decisions)
    on = policy.decide(_view(windows, a2a_schedule="aurora"), _params(), 0.0)
    assert on.a2a_schedule is None and not any(d.kind == "schedule" for d in on.decisions)


def _window(helpers, start, epoch, over_bound, transfer_seconds=0.05):
    load = np.full((L, E), 400)
    w = helpers.make_window(load, helpers.contiguous(L, E, P), W, start_time=start, epoch=epoch,
                            transfer_seconds=transfer_seconds)
    a2a = w.dispatch_seconds + w.combine_seconds
    bound = a2a.max(axis=1) / over_bound
    return w.replace(a2a_bound_seconds=bound, a2a_over_bound=tm.a2a_over_bound(a2a, bound))


def test_the_agent_sends_the_order_verifies_it_and_rolls_it_back(start_agent, helpers):
    from moewatch import wire
    from moewatch.agent.audit import read_audit

    daemon = start_agent(policy={"mode": "act"}, verify={"windows": 2})
    rt = helpers.FakeRuntime(daemon.cfg.server.socket, num_slots=P,
                             capabilities=("plan", "capacity", "schedule")).connect()
    group = helpers.wait_group(daemon)
    for i in range(2):
        rt.send(_window(helpers, 1000.0 + 10 * i, 0, over_bound=3.0))
    assert helpers.wait_for(lambda: len(group.history) == 2)
    daemon.controller.plan_tick()
    plan = rt.wait_plan()
    assert plan is not None and plan.epoch == 1 and plan.a2a_schedule == "aurora"
    rt.send(wire.Ack(plan_epoch=1, epoch_in_force=1, ok=True))
    ctl = daemon.controller.control(group.key)
    assert helpers.wait_for(lambda: ctl.verifying is not None)
    assert ctl.a2a_schedule == "aurora"
    # The order made the layers slower (a made-up regression: three times the transfer): rolled back.
    for i in range(3):
        rt.send(_window(helpers, 1200.0 + 10 * i, 1, over_bound=9.0, transfer_seconds=0.15))
    rollback = rt.wait_plan()
    assert rollback is not None and rollback.meta["rollback_of"] == 1
    assert rollback.a2a_schedule == "none"  # the order before the plan (the runtime's default)
    rt.send(wire.Ack(plan_epoch=rollback.epoch, epoch_in_force=rollback.epoch, ok=True))
    assert helpers.wait_for(lambda: ctl.a2a_schedule == "none")
    assert helpers.wait_for(lambda: daemon.metrics.get("moewatch_actions_total", ("m", "g", "schedule", "rolled_back")) == 2)
    events = [r["event"] for r in read_audit(daemon.cfg.log.audit_log)]
    assert "rollback" in events and events[-1] == "rolled_back"
