"""The all-to-all's order as a Plan field (moewatch/plan.py `a2a_schedule`, additive) applied by the
reference runtime at a step boundary on every rank (runtime/control.py), outputs unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from moewatch.plan import Plan, PlanError
from moewatch.runtime.config import RuntimeConfig
from moewatch.runtime.launcher import launch

pytestmark = pytest.mark.slow


def test_plan_field_is_optional_validated_and_round_trips():
    pmap, cap = [[0, 1, 2, 3]], [0.0]
    plain = Plan(1, pmap, cap)
    assert plain.a2a_schedule is None and "a2a_schedule" not in plain.to_dict()  # an older reader's plan
    ordered = Plan(2, pmap, cap, a2a_schedule="aurora")
    assert Plan.from_dict(ordered.to_dict()).a2a_schedule == "aurora"
    assert Plan.from_dict(plain.to_dict()).a2a_schedule is None
    with pytest.raises(PlanError) as err:
        Plan(3, pmap, cap, a2a_schedule="sjf")
    assert err.value.field == "a2a_schedule"


def test_a_plan_switches_the_order_at_a_boundary_and_back_outputs_unchanged():
    base = RuntimeConfig(ranks=2, layers=2, experts=4, hidden=32, ffn=32, batch_tokens=32, steps=8,
                         warmup_steps=0, a2a_log=True, probe=False, zipf=1.3)
    pmap = np.tile(np.arange(4), (2, 1)).tolist()
    switched = launch(base.replace(scripted_plans=[
        (2, Plan(1, pmap, [0.0, 0.0], "order the exchange", a2a_schedule="aurora").to_dict()),
        (5, Plan(2, pmap, [0.0, 0.0], "roll back the order", a2a_schedule="none").to_dict())]))
    assert [a["ok"] for a in switched.acks] == [True, True]
    assert switched.a2a["schedule_at_end"] == "none" and switched.epoch == 2
    kept = launch(base.replace(scripted_plans=[
        (2, Plan(1, pmap, [0.0, 0.0], "order the exchange", a2a_schedule="aurora").to_dict())]))
    assert kept.a2a["schedule_at_end"] == "aurora"
    plain = launch(base)
    assert plain.a2a["schedule_at_end"] == "none"
    # Every step's output, every rank: the order never changes what is computed.
    assert switched.a2a["output_digests"] == plain.a2a["output_digests"] == kept.a2a["output_digests"]
