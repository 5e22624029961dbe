"""The watch on the engine's own rebalancing: windows say how it is configured (extra.rebalancing) and
carry a record per rebalance (extra.engine_rebalance); when none comes in two intervals of steps while
the engine steps, the agent says overdue (moewatch_engine_rebalance_overdue 1, a log line, an audit
line); while they keep coming it stays quiet. Each rebalance's window gives its step stall."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from moewatch.agent import rebalance_watchdog as rw
from moewatch.engine_rebalancing import RebalancingSettings

GROUP = ("m", "g")
INTERVAL, STEPS = 10, 4  # the engine rebalances every 10 steps; each window holds 4
WATCHED = RebalancingSettings(INTERVAL, asynchronous=True, observed=True, source="test engine_config")
RECORD = {"engine": "test", "call": 0, "layer_outcomes": {"kept_static": 2}}


def test_overdue_after_two_intervals_of_steps_without_a_rebalance():
    watch = rw.step(rw.Watch(), WATCHED, STEPS, rebalanced=True)
    assert watch.armed and watch.steps_since == 0 and watch.rebalances == 1
    for _ in range(5):  # 20 steps: two intervals, not more
        watch = rw.step(watch, WATCHED, STEPS, rebalanced=False)
        assert not watch.overdue
    watch = rw.step(watch, WATCHED, STEPS, rebalanced=False)
    assert watch.overdue and watch.steps_since == 24
    assert not rw.step(watch, WATCHED, STEPS, rebalanced=True).overdue  # a late one clears it


def test_an_idle_engine_an_unobserved_one_and_one_without_settings_are_never_overdue():
    watch = rw.step(rw.Watch(), WATCHED, STEPS, rebalanced=True)
    for _ in range(50):
        watch = rw.step(watch, WATCHED, 0, rebalanced=False)  # windows of no steps
    assert not watch.overdue and watch.steps_since == 0
    unobserved = RebalancingSettings(INTERVAL, observed=False)
    watch = rw.Watch()
    for _ in range(50):
        watch = rw.step(watch, unobserved, STEPS, rebalanced=False)
    assert not watch.armed and not watch.overdue
    assert rw.step(rw.Watch(WATCHED, 100), None, STEPS, rebalanced=False) == rw.Watch()


def test_the_step_stall_is_the_longest_step_over_the_median():
    assert rw.step_stall_seconds(np.array([0.1, 0.1, 2.1, 0.1])) == pytest.approx(2.0)
    assert rw.step_stall_seconds(np.array([0.1])) is None and rw.step_stall_seconds(None) is None


@pytest.mark.parametrize("raw, field", [
    ({"asynchronous": True}, "interval_steps: missing"),
    ({"interval_steps": 0}, "interval_steps"),
    ({"interval_steps": 10, "observed": "yes"}, "observed"),
    ([], "extra.rebalancing: must be an object"),
])
def test_malformed_settings_are_refused_naming_the_field(raw, field):
    with pytest.raises(ValueError, match=field):
        RebalancingSettings.from_extra({"rebalancing": raw})


def test_later_fields_are_read_additively():
    got = RebalancingSettings.from_extra({"rebalancing": {"interval_steps": 5, "observed": True, "window": 9}})
    assert got == RebalancingSettings(5, observed=True)
    assert RebalancingSettings.from_extra({}) is None


def windows(helpers, rebalance_every: int | None, count: int, stall_in_first: bool = False):
    """`count` windows of STEPS steps each carrying WATCHED; a rebalance record in the first and then
    in every `rebalance_every`-th (None: only the first)."""
    load, pmap = helpers.hot_load(2, 8, hot=0), helpers.contiguous(2, 8, 12)
    out = []
    for i in range(count):
        w = helpers.make_window(load, pmap, 4, steps=STEPS, start_time=1000.0 + 10 * i)
        extra = {**w.extra, **WATCHED.to_extra()}
        if i == 0 or (rebalance_every is not None and i % rebalance_every == 0):
            extra["engine_rebalance"] = [dict(RECORD, call=i)]
        w = w.replace(extra=extra)
        if i == 0 and stall_in_first:
            w = w.replace(step_seconds=np.array([0.1, 0.1, 1.6, 0.1]))
        out.append(w)
    return out


def run_through_agent(daemon, helpers, ws) -> list[float]:
    """Each window through the agent in turn; the overdue gauge after each."""
    seen = []
    for i, w in enumerate(ws):
        assert daemon.ingest_window(w) is None
        assert helpers.wait_for(lambda: daemon.store.get(GROUP) is not None and daemon.store.get(GROUP).status()
                         ["history"] >= i + 1, timeout=10)
        seen.append(daemon.metrics.get("moewatch_engine_rebalance_overdue", GROUP))
    return seen


def overdue_audit_lines(daemon, short_tmp) -> list[dict]:
    daemon.audit.sync()
    return [json.loads(x) for x in (short_tmp / "audit.jsonl").read_text().splitlines()
            if '"engine_rebalance_overdue"' in x]


def test_the_agent_says_overdue_when_the_engine_stops_rebalancing(helpers, start_agent, short_tmp):
    daemon = start_agent()
    seen = run_through_agent(daemon, helpers, windows(helpers, None, 8, stall_in_first=True))
    # 5 windows after the rebalance are 20 steps (two intervals): quiet; the 6th passes them.
    assert seen == [0.0] * 6 + [1.0] * 2
    assert daemon.metrics.get("moewatch_engine_rebalance_steps_since_last", GROUP) == 7 * STEPS
    assert daemon.metrics.get("moewatch_engine_rebalance_interval_steps", GROUP) == INTERVAL
    assert daemon.metrics.get("moewatch_engine_rebalance_asynchronous", GROUP) == 1.0
    lines = overdue_audit_lines(daemon, short_tmp)
    assert len(lines) == 1 and lines[0]["steps_since"] == 6 * STEPS and lines[0]["interval_steps"] == INTERVAL
    status = [g for g in daemon.status()["groups"] if (g["model"], g["ep_group"]) == GROUP][0]["rebalancing"]
    assert status["overdue"] is True and status["rebalances"] == 1 and status["source"] == "test engine_config"
    [(_, buckets, total)] = daemon.metrics.histogram_series("moewatch_engine_rebalance_step_stall_seconds")
    assert total == pytest.approx(1.5)  # the longest step over the median, in the rebalance's window
    assert dict(buckets)["1.0"] == 0 and dict(buckets)["2.5"] == 1


def test_the_agent_stays_quiet_while_the_engine_keeps_rebalancing(helpers, start_agent, short_tmp):
    daemon = start_agent()
    seen = run_through_agent(daemon, helpers, windows(helpers, 3, 12))  # every 12 steps: within two intervals
    assert seen == [0.0] * 12
    assert overdue_audit_lines(daemon, short_tmp) == []
