"""The SGLang actuator end to end: the agent's plan becomes an `--init-expert-location` file that
SGLang's own loader accepts, with its epoch and reason beside it, and the operator's command runs once
per applied plan; the cost gate weighs what applying costs SGLang."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from moewatch.integrations.sglang.actuator import SGLangActuator
from moewatch.agent.audit import read_audit
from moewatch.plan import Plan

L, E, P, W = 2, 8, 12, 4


def sglang_reads(location, num_layers, num_experts, num_slots, ep_size, monkeypatch):
    """The map SGLang builds from the file at start (python/sglang/srt/eplb/expert_location.py,
    compute_initial_expert_location_metadata -> ExpertLocationMetadata.init_by_mapping)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt import runtime_context
        from sglang.srt.eplb import expert_location
    # SGLang finds L and E from the model's architecture class; there is no model here, so that one
    # lookup answers with the sizes the model would give.
    monkeypatch.setattr(expert_location.ModelConfigForExpertLocation, "from_model_config", staticmethod(
        lambda model_config: expert_location.ModelConfigForExpertLocation(num_layers=num_layers,
                                                                          num_logical_experts=num_experts)))
    override = runtime_context._CONTEXT.override_server_args(
        init_expert_location=str(location), tp_size=ep_size, ep_size=ep_size,
        ep_num_redundant_experts=num_slots - num_experts)
    with override:
        meta = expert_location.compute_initial_expert_location_metadata(None, moe_ep_rank=0)
    return meta.physical_to_logical_map.numpy(), meta.ep_size


def feed(rt, helpers, load, pmap, n, start, epoch=0):
    for i in range(n):
        rt.send(helpers.make_window(load, pmap, W, start_time=start + 10 * i, epoch=epoch))


def test_plan_becomes_a_file_sglang_loads_and_the_command_runs_once(start_agent, helpers, short_tmp, monkeypatch):
    location = short_tmp / "sglang" / "expert_location.json"
    marker = short_tmp / "restarts"
    daemon = start_agent(policy={"mode": "act"}, verify={"windows": 2},
                         sglang={"actuate": True, "location_file": str(location), "apply_seconds": 0.5,
                                 "command": f"sh -c 'echo $MOEWATCH_PLAN_EPOCH >> {marker}'"})
    rt = helpers.FakeRuntime(daemon.cfg.server.socket).connect()
    group = helpers.wait_group(daemon)
    load, old = helpers.hot_load(L, E), helpers.contiguous(L, E, P)
    feed(rt, helpers, load, old, 2, 1000.0)
    assert helpers.wait_for(lambda: len(group.history) == 2)
    daemon.controller.plan_tick()
    # The apply runs off the controller's lock; its Ack puts the plan under verification.
    assert helpers.wait_for(lambda: daemon.controller.control(group.key).verifying is not None)
    daemon.controller.plan_tick()  # the plan is under verification: nothing new is applied
    assert marker.read_text().split() == ["1"]
    written = json.loads(location.read_text())
    assert list(written) == ["physical_to_logical_map"]
    sent = next(r for r in read_audit(daemon.cfg.log.audit_log) if r["event"] == "plan_sent")
    applied = next(r for r in read_audit(daemon.cfg.log.audit_log) if r["event"] == "plan_applied")
    assert sent["epoch"] == applied["epoch"] == 1
    record = json.loads(location.with_name(location.name + ".moewatch.json").read_text())
    assert record["epoch"] == 1 and record["ok"] and record["reason"] == sent["reason"]
    # SGLang's loader reads back exactly the map the agent decided.
    pmap, ep_size = sglang_reads(location, L, E, P, W, monkeypatch)
    assert np.array_equal(pmap, np.array(written["physical_to_logical_map"])) and ep_size == W
    decision = next(r for r in read_audit(daemon.cfg.log.audit_log)
                    if r["event"] == "decision" and r["result"] == "proposed")
    assert decision["after"]["predicted_stall_seconds"] >= 0.5


def test_applying_the_same_plan_again_does_not_rerun_the_command(short_tmp, helpers):
    location = short_tmp / "loc.json"
    marker = short_tmp / "ran"
    settings = helpers.sglang_settings(location_file=str(location), command=f"sh -c 'echo x >> {marker}'")
    actuator = SGLangActuator(settings)
    plan = Plan(4, np.tile(np.arange(P) % E, (L, 1)), np.zeros(L), "hot expert 0")
    first, again = actuator.apply(("m", "g"), plan), actuator.apply(("m", "g"), plan)
    assert first.status == again.status == "applied" and "already applied" in again.detail
    assert marker.read_text().split() == ["x"]
    newer = Plan(5, plan.physical_to_logical_map, np.zeros(L), "again")
    assert actuator.apply(("m", "g"), newer).status == "applied"
    assert marker.read_text().split() == ["x", "x"]
    assert json.loads(actuator.record_file.read_text())["epoch"] == 5


def test_cost_gate_skips_a_plan_worth_less_than_sglang_apply_cost(start_agent, helpers, short_tmp):
    location = short_tmp / "loc.json"
    daemon = start_agent(policy={"mode": "act"}, sglang={"actuate": True, "location_file": str(location),
                                                         "apply_seconds": 86_400})
    rt = helpers.FakeRuntime(daemon.cfg.server.socket).connect()
    group = helpers.wait_group(daemon)
    feed(rt, helpers, helpers.hot_load(L, E), helpers.contiguous(L, E, P), 2, 1000.0)
    assert helpers.wait_for(lambda: len(group.history) == 2)
    daemon.controller.plan_tick()
    assert not location.exists()
    skipped = [r for r in read_audit(daemon.cfg.log.audit_log) if r["event"] == "decision"]
    assert skipped and all(r["result"] == "skipped" and "86400.000 s stall" in r["reason"] for r in skipped)


@pytest.mark.parametrize("value", ["-1", "x"])
def test_apply_seconds_is_validated(value):
    from moewatch.agent.config import build_config
    from moewatch.thresholds import ConfigError

    with pytest.raises(ConfigError, match="^MOEWATCH_SGLANG__APPLY_SECONDS: "):
        build_config(environ={"MOEWATCH_SGLANG__APPLY_SECONDS": value})
