"""An apply is a job off the controller's lock and the scheduler's thread: a rolling restart that takes
30 s leaves every other group verified, /status answering, and comes back through the Ack path."""

from __future__ import annotations

import threading
import time
import urllib.request

from moewatch import wire
from moewatch.integrations.base import Actuation, ActuatorProperties
from moewatch.integrations.reference.actuator import RuntimeActuator
from moewatch.integrations.sglang.actuator import SGLangActuator
from moewatch.agent.audit import read_audit
from moewatch.agent.daemon import ACTUATION_STOP_SECONDS

import pytest

L, E, P, W = 2, 8, 12, 4


class ByModel:
    """One actuator per model, the runtime's for the others (a test stand-in for a mixed fleet)."""

    name = "by-model"
    properties = ActuatorProperties()  # live, placement and capacity: the reference runtime's

    def __init__(self, special: dict, default):
        self.special = special
        self.default = default

    def apply(self, group_key, plan):
        return self.special.get(group_key[0], self.default).apply(group_key, plan)


class Blocking:
    name = "blocking"
    properties = ActuatorProperties()

    def __init__(self):
        self.release = threading.Event()
        self.entered = threading.Event()

    def apply(self, group_key, plan):
        self.entered.set()
        self.release.wait()
        return Actuation("failed", "released")


def use_actuator(daemon, actuator):
    daemon.controller.actuator = actuator
    daemon.actuation.actuator = actuator


def feed(rt, helpers, n, start, epoch=0, pmap=None):
    pmap = helpers.contiguous(L, E, P) if pmap is None else pmap
    for i in range(n):
        rt.send(helpers.make_window(helpers.hot_load(L, E), pmap, W, start_time=start + 10 * i, epoch=epoch,
                                   model=rt.hello.model))


def hot_group(daemon, helpers, model):
    rt = helpers.FakeRuntime(daemon.cfg.server.socket, model=model).connect()
    group = helpers.wait_group(daemon, (model, "g"))
    feed(rt, helpers, 2, 1000.0)
    assert helpers.wait_for(lambda: len(group.history) == 2)
    return rt, group


def events(daemon, model):
    return [r for r in read_audit(daemon.cfg.log.audit_log) if r.get("model") == model]


def timed_get(url: str) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        resp.read()
    return time.perf_counter() - started


@pytest.mark.slow
def test_a_30_second_apply_blocks_no_other_group_nor_status(start_agent, helpers, short_tmp):
    daemon = start_agent(policy={"mode": "act"}, verify={"windows": 2})
    slow_file = short_tmp / "slow" / "expert_location.json"
    slow_apply = SGLangActuator(helpers.sglang_settings(location_file=str(slow_file), command="sleep 30"))
    use_actuator(daemon, ByModel({"slow": slow_apply}, RuntimeActuator(daemon.connection_of)))
    slow_rt, slow = hot_group(daemon, helpers, "slow")
    started = time.monotonic()
    daemon.plan_job()  # the scheduler's thread hands the apply over and goes on
    assert time.monotonic() - started < 5
    assert daemon.controller.status(slow.key)["in_flight"] is not None
    assert helpers.wait_for(lambda: daemon.actuation.busy(slow.key))

    # Another group is planned, acknowledged and verified while the command sleeps.
    fast_rt, fast = hot_group(daemon, helpers, "fast")
    daemon.plan_job()
    plan = fast_rt.wait_plan()
    assert plan is not None
    fast_rt.send(wire.Ack(plan_epoch=plan.epoch, epoch_in_force=plan.epoch, ok=True))
    assert helpers.wait_for(lambda: daemon.controller.control(fast.key).verifying is not None)
    feed(fast_rt, helpers, 3, 2000.0, epoch=plan.epoch, pmap=plan.physical_to_logical_map)
    assert helpers.wait_for(lambda: "verified" in [r["event"] for r in events(daemon, "fast")])
    # /status and /metrics answer at once, every time.
    for _ in range(5):
        assert timed_get(daemon.http_url + "/status") < 0.1
        assert timed_get(daemon.http_url + "/metrics") < 0.5
    assert daemon.actuation.busy(slow.key), "the command was still running through all of this"
    assert not [r for r in events(daemon, "slow") if r["event"] in ("actuation_finished", "plan_applied")]

    # The command ends: its outcome comes back as the plan's Ack, audited, and verification starts.
    assert helpers.wait_for(lambda: "plan_applied" in [r["event"] for r in events(daemon, "slow")], timeout=60)
    finished = next(r for r in events(daemon, "slow") if r["event"] == "actuation_finished")
    assert finished["status"] == "applied" and finished["in_flight"] and finished["seconds"] >= 29
    assert time.monotonic() - started >= 29
    assert daemon.controller.control(slow.key).verifying is not None
    verified_fast = next(r for r in events(daemon, "fast") if r["event"] == "verified")
    assert verified_fast["time"] < finished["time"]
    assert daemon.metrics.get("moewatch_actions_total", ("slow", "g", "replicate", "applied")) == 2
    slow_rt.close()
    fast_rt.close()


def test_stop_does_not_wait_for_an_apply_that_never_ends(start_agent, helpers):
    daemon = start_agent(policy={"mode": "act"})
    blocking = Blocking()
    use_actuator(daemon, blocking)
    rt, group = hot_group(daemon, helpers, "m")
    daemon.plan_job()
    assert blocking.entered.wait(5)
    started = time.monotonic()
    daemon.stop()
    assert time.monotonic() - started < ACTUATION_STOP_SECONDS + 3
    left = [r for r in read_audit(daemon.cfg.log.audit_log) if r["event"] == "actuation_unfinished"]
    assert len(left) == 1 and left[0]["running"] and left[0]["model"] == "m"
    assert left[0]["seconds"] >= ACTUATION_STOP_SECONDS - 0.5
    assert read_audit(daemon.cfg.log.audit_log)[-1]["event"] == "agent_stopped"
    blocking.release.set()  # its late outcome is dropped: the agent has stopped
    rt.close()


def test_the_ack_timeout_fails_a_plan_whose_apply_still_runs_and_its_late_outcome_is_audited(start_agent, helpers):
    daemon = start_agent(policy={"mode": "act"}, verify={"ack_timeout_seconds": 0.3})
    blocking = Blocking()
    use_actuator(daemon, blocking)
    rt, group = hot_group(daemon, helpers, "m")
    daemon.plan_job()
    assert blocking.entered.wait(5)
    failed = lambda: [r for r in read_audit(daemon.cfg.log.audit_log) if r["event"] == "plan_failed"]  # noqa: E731
    assert helpers.wait_for(failed)  # the export job's timeout check, while apply() is still blocked
    assert failed()[0]["error"] == "no Ack within 0.3 s" and daemon.actuation.busy(group.key)
    assert daemon.controller.status(group.key)["in_flight"] is None
    blocking.release.set()
    late = lambda: [r for r in read_audit(daemon.cfg.log.audit_log) if r["event"] == "actuation_finished"]  # noqa: E731
    assert helpers.wait_for(late)
    assert late()[0]["in_flight"] is False and late()[0]["detail"] == "released"
    assert helpers.wait_for(lambda: not daemon.actuation.busy(group.key))
    assert len(failed()) == 1  # the late failure does not fail the plan twice
    rt.close()
