"""A new engine added from here alone: a source the agent polls for windows of its own runtime, and an
actuator that records the plans it gets and acknowledges them. Registered in the integrations
registry, the agent ingests, triages, decides (act mode, a persistent hot expert), applies through
that actuator and verifies the new epoch, with nothing outside this file knowing the engine."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from moewatch.agent.audit import read_audit
from moewatch.integrations import registry
from moewatch.integrations.base import PLACEMENT, Actuation, ActuatorProperties, Integration
from moewatch.planner import placement_math as pm
from moewatch.wire import Ack

L, E, P, W = 2, 8, 12, 4
RUNTIME = "toy-engine"


class ToyEngine:
    """The engine's state as both halves see it: the placement and epoch in force."""

    def __init__(self, helpers):
        self.helpers = helpers
        self.load = helpers.hot_load(L, E)
        self.pmap = helpers.contiguous(L, E, P)
        self.epoch = 0
        self.windows = 0
        self.windows_of_epoch = 0
        self.lock = threading.Lock()

    def next_window(self):
        with self.lock:
            self.windows += 1
            self.windows_of_epoch += 1
            window = self.helpers.make_window(self.load, self.pmap, W, epoch=self.epoch, model="toy",
                                              ep_group="pod", start_time=1000.0 + 10 * self.windows)
        return window.replace(runtime=RUNTIME)


class ToySource:
    job_name = "toy_source"
    capabilities = frozenset({PLACEMENT})

    def __init__(self, engine: ToyEngine, poll_seconds: float, windows_per_epoch: int = 4):
        self.engine, self.poll_seconds, self.windows_per_epoch = engine, poll_seconds, windows_per_epoch
        self.refused: list[str] = []

    def poll(self, ingest) -> None:
        if self.engine.windows_of_epoch >= self.windows_per_epoch:
            return  # a few windows per epoch keep the test short
        reason = ingest(self.engine.next_window())
        if reason is not None:
            self.refused.append(reason)

    def status(self):
        return {"windows": self.engine.windows, "refused": list(self.refused)}


class RecordingActuator:
    name = "toy"
    properties = ActuatorProperties(live=True, apply_seconds=0.0, applies=frozenset({PLACEMENT}))

    def __init__(self, engine: ToyEngine):
        self.engine = engine
        self.plans = []

    def apply(self, group_key, plan) -> Actuation:
        self.plans.append((group_key, plan))
        with self.engine.lock:
            self.engine.pmap = np.array(plan.physical_to_logical_map)
            self.engine.epoch = plan.epoch
            self.engine.windows_of_epoch = 0
        ack = Ack(plan_epoch=plan.epoch, epoch_in_force=plan.epoch, ok=True, layers_changed=plan.num_layers)
        return Actuation("applied", f"toy engine runs epoch {plan.epoch}", ack)


@pytest.fixture
def toy_engine(helpers):
    engine = ToyEngine(helpers)
    settings = SimpleNamespace(poll_seconds=0.05, actuate=True)
    parts = {}

    def make_source(s):
        parts["source"] = ToySource(engine, s.poll_seconds)
        return parts["source"]

    def make_actuator(s, connection_of):
        parts["actuator"] = RecordingActuator(engine)
        return parts["actuator"]

    registry.register(Integration(name="toy", runtimes=frozenset({RUNTIME}), settings_section="toy",
                                  settings_of=lambda cfg: settings, make_source=make_source,
                                  make_actuator=make_actuator))
    yield engine, parts
    registry.unregister("toy")


def test_a_new_engine_is_ingested_triaged_decided_and_applied(toy_engine, start_agent, helpers):
    engine, parts = toy_engine
    daemon = start_agent(policy={"mode": "act"}, verify={"windows": 3})
    assert daemon.controller.actuator is parts["actuator"]
    key = ("toy", "pod")
    assert helpers.wait_for(lambda: daemon.store.get(key) is not None and len(daemon.store.get(key).history) >= 2)
    group = daemon.store.get(key)
    latest = group.latest()
    assert latest.window.runtime == RUNTIME
    assert {d.verdict for d in latest.diagnosis.layers} == {"imbalance-bound"}
    before = pm.placement_balancedness(engine.load.astype(float), helpers.contiguous(L, E, P), W)

    daemon.plan_job()

    actuator = parts["actuator"]
    assert len(actuator.plans) == 1
    (sent_to, plan), = actuator.plans
    assert sent_to == key and plan.epoch == 1
    assert (pm.replica_counts_of(plan.physical_to_logical_map, E)[:, 0] > 1).all(), "the hot expert got replicas"
    after = pm.placement_balancedness(engine.load.astype(float), plan.physical_to_logical_map, W)
    assert (after > before + 0.1).all()
    # The new epoch's windows come from the source; the agent keeps the plan on their evidence.
    assert helpers.wait_for(lambda: any(r["event"] == "verified" for r in read_audit(daemon.cfg.log.audit_log)))
    events = [r["event"] for r in read_audit(daemon.cfg.log.audit_log) if r.get("model") == "toy"]
    assert events.index("plan_sent") < events.index("plan_applied") < events.index("verified")
    assert "rollback" not in events
    assert daemon.status()["toy"] == {"windows": engine.windows, "refused": []}
    assert daemon.controller.status(key)["plans_applied"] == 1


def test_register_refuses_a_taken_name_or_runtime_and_unregister_removes():
    taken = next(iter(registry.get("sglang").runtimes))
    with pytest.raises(ValueError, match="registered already"):
        registry.register(Integration(name="sglang"))
    with pytest.raises(ValueError, match=f"runtime '{taken}' is covered by 'sglang'"):
        registry.register(Integration(name="other", runtimes=frozenset({taken})))
    registry.register(Integration(name="other", runtimes=frozenset({"other-engine"})))
    assert registry.covering("other-engine").name == "other"
    registry.unregister("other")
    assert registry.covering("other-engine") is None
    assert [i.name for i in registry.integrations()] == ["reference", "sglang", "vllm", "slo"]


def test_two_engines_asking_to_steer_is_refused_at_start(toy_engine, start_agent, short_tmp):
    from moewatch.agent.daemon import StartupError

    with pytest.raises(StartupError, match="^actuator: only one engine's actuator can steer the agent's plans, "
                                           "asked: sglang, toy$"):
        start_agent(policy={"mode": "act"}, sglang={"actuate": True, "location_file": str(short_tmp / "loc.json")})
