"""The rebalance ledger in the agent (agent/ledger.py): windows carrying an engine's own rebalance record
settle an entry once verify.windows windows came after it; the entry is audited (rebalance_ledger),
exported (moewatch_rebalance_ledger_*), on /status and in `moewatch top`. A controller's plan_applied
entry becomes the agent's plan in the ledger."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from moewatch.agent.ledger import applied_plan
from moewatch.agent.top import render

L, E, P, W = 2, 8, 12, 4
STEPS = 4


def windows(helpers, stall: float):
    """Six windows 1 s apart: 10 ms steps, the third (carrying vLLM's own rebalance record) with one step
    `stall` longer, then 8 ms steps on a better map."""
    load, pmap = helpers.hot_load(L, E, hot=0), helpers.contiguous(L, E, P)
    out = []
    for i in range(6):
        seconds = np.full(STEPS, 0.010 if i < 3 else 0.008)
        extra = {"rebalancing": {"interval_steps": 1000, "asynchronous": False, "observed": True, "source": "test"}}
        if i == 2:
            seconds[-1] += stall
            extra["engine_rebalance"] = [{"engine": "vllm", "policy": "engine", "call": 0, "digest": "d",
                                          "time": 1002.5, "layers_changed": [0], "slots_moved": 3,
                                          "bytes_moved": 3000.0}]
        w = helpers.make_window(load, pmap, W, start_time=1000.0 + i, steps=STEPS)
        out.append(w.replace(step_seconds=seconds, end_time=1000.5 + i, extra={**w.extra, **extra}))
    return out


def test_an_engine_rebalance_is_settled_audited_exported_and_shown(helpers, start_agent, short_tmp):
    daemon = start_agent(verify={"windows": 3})
    for w in windows(helpers, stall=0.25):
        assert daemon.ingest_window(w) is None
    assert helpers.wait_for(lambda: daemon.ledgers.status(("m", "g")) is not None)
    stall, gain = 0.25, 0.002
    text = helpers.scrape(daemon.http_url)
    labels = {"model": "m", "ep_group": "g", "policy": "engine_own"}
    assert helpers.sample_value(text, "moewatch_rebalance_ledger_stall_seconds", **labels) == pytest.approx(stall)
    assert helpers.sample_value(text, "moewatch_rebalance_ledger_gain_per_step_seconds", **labels) == pytest.approx(gain)
    assert helpers.sample_value(text, "moewatch_rebalance_ledger_net_seconds", **labels) == pytest.approx(
        gain * 1000 - stall)
    assert helpers.sample_value(text, "moewatch_rebalance_ledger_break_even_steps", **labels) == pytest.approx(
        stall / gain)
    assert helpers.sample_value(text, "moewatch_rebalance_ledger_entries_total", outcome="paid", **labels) == 1
    assert helpers.sample_value(text, "moewatch_rebalance_ledger_step_seconds", phase="during", **labels) == \
        pytest.approx(0.010 + stall / STEPS)
    daemon.audit.sync()
    [line] = [json.loads(x) for x in (short_tmp / "audit.jsonl").read_text().splitlines()
              if '"rebalance_ledger"' in x]
    assert (line["model"], line["ep_group"], line["engine"], line["outcome"]) == ("m", "g", "vllm", "paid")
    assert line["stall_seconds"] == pytest.approx(stall) and line["horizon"] == "configured_interval"
    with urllib.request.urlopen(daemon.http_url + "/status", timeout=5) as resp:
        status = json.loads(resp.read())
    [group] = status["groups"]
    assert group["ledger"]["entries"] == 1 and group["ledger"]["last"]["outcome"] == "paid"
    shown = render(status, colour=False)
    assert "ledger: last rebalance" in shown and "by vllm's own policy: paid, net +1.750 s over 1000 steps" in shown


def test_a_controller_entry_of_a_plan_in_force_is_the_agents_plan_in_the_ledger():
    entry = {"time": 20.0, "event": "plan_applied", "model": "m", "ep_group": "g", "epoch": 3, "layers": [1, 2],
             "stall_seconds": 0.4, "sent_at": 10.0, "applied_at": 12.0, "slots_moved": 5, "bytes_moved": 5e6}
    plan = applied_plan(entry, "moewatch-runtime")
    assert (plan.epoch, plan.sent_at, plan.applied_at, plan.layers_changed, plan.slots_moved) == (3, 10.0, 12.0,
                                                                                                   (1, 2), 5)
    assert plan.between_steps_stall_seconds == 0.4 and plan.rollback_of is None
    assert applied_plan({**entry, "event": "rolled_back", "rollback_of": 2}).rollback_of == 2
    assert applied_plan({**entry, "event": "verified"}) is None
    assert applied_plan({k: v for k, v in entry.items() if k != "sent_at"}) is None


def test_the_entries_counters_start_at_zero_with_the_group(helpers, start_agent):
    daemon = start_agent()
    w = windows(helpers, stall=0.0)[0]
    assert daemon.ingest_window(w) is None
    assert helpers.wait_for(lambda: helpers.sample_value(helpers.scrape(daemon.http_url),
                                                         "moewatch_rebalance_ledger_entries_total",
                                                         policy="agent_plan", outcome="did_not_pay") == 0)


def test_a_policy_that_stops_paying_is_logged_once_until_one_pays(caplog):
    from moewatch.agent.ledger import RebalanceLedgers
    from moewatch.agent.metrics.state import MetricsState

    ledgers = RebalanceLedgers(MetricsState(), lambda: None, windows=1)
    entry = {"policy": "engine_own", "engine": "vllm", "rebalanced_at": 1.0, "stall_seconds": 1.0,
             "gain_seconds_per_step": 0.0, "net_seconds": -1.0, "horizon_steps": 10, "break_even_steps": None}
    caplog.set_level("INFO", logger="moewatch.agent.ledger")
    for outcome in ("did_not_pay", "did_not_pay", "paid", "did_not_pay"):
        ledgers._settled(("m", "g"), [{**entry, "outcome": outcome}])
    assert len([r for r in caplog.records if "did not pay" in r.getMessage()]) == 2
    assert ledgers.status(("m", "g"))["did_not_pay"] == 3 and ledgers.status(("m", "g"))["paid"] == 1
