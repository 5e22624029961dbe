"""The rebalance ledger's core (moewatch/ledger.py) on hand-built windows: which windows are before,
during and after a rebalance, and the stall, gain, net and break-even worked out from them."""

from __future__ import annotations

import numpy as np
import pytest

from moewatch.ledger import AppliedPlan, Ledger, SloInterval, break_even_steps, net_seconds, policy_label, \
    stall_seconds

STEPS = 10


def steps_of(seconds: float, stall: float = 0.0) -> list[float]:
    """A window's step times: STEPS steps of `seconds`, the last one `stall` longer."""
    out = [seconds] * STEPS
    out[-1] += stall
    return out


def vllm_record(layers, slots, **more):
    return {"engine": "vllm", "policy": "engine", "call": 1, "digest": "ab", "time": 1003.5, "layers_changed": layers,
            "slots_moved": slots, "bytes_moved": 1000.0 * slots, **more}


def feed(ledger: Ledger, windows: list[dict]) -> list[dict]:
    settled = []
    for i, w in enumerate(windows):
        settled += ledger.add_window(1000.0 + i, 1001.0 + i, w.get("epoch", 0), STEPS, w["steps"],
                                     np.array(w.get("bal", [0.5, 0.7])), w.get("records", ()),
                                     w.get("interval"), w.get("slo"))
    return settled


def test_an_engine_rebalance_that_did_not_pay_over_its_configured_interval():
    ledger = Ledger(windows=2)
    windows = [{"steps": steps_of(0.010), "interval": 100}, {"steps": steps_of(0.010), "interval": 100},
               {"steps": steps_of(0.010, stall=0.5), "records": [vllm_record([0], 4)], "interval": 100},
               {"steps": steps_of(0.008), "bal": [0.9, 0.8], "interval": 100}]
    assert feed(ledger, windows) == []  # one window after it: still open
    [entry] = ledger.add_window(1004.0, 1005.0, 0, STEPS, steps_of(0.008), np.array([0.9, 0.8]), interval_steps=100)
    assert entry["settled"] and entry["policy"] == "engine_own" and entry["engine"] == "vllm"
    assert entry["layers_changed"] == [0] and entry["slots_moved"] == 4 and entry["bytes_moved"] == 4000.0
    assert entry["windows"] == {"before": 2, "during": 1, "after": 2}
    assert entry["step_seconds_before"] == pytest.approx(0.010, rel=1e-12)
    assert entry["step_seconds_during"] == pytest.approx(0.060, rel=1e-12)
    assert entry["step_seconds_after"] == pytest.approx(0.008, rel=1e-12)
    assert entry["stall_seconds"] == pytest.approx(0.5, rel=1e-12)  # 0.6 s in 10 steps, paced 0.1 s before
    assert entry["gain_seconds_per_step"] == pytest.approx(0.002, rel=1e-9)
    assert (entry["horizon_steps"], entry["horizon"]) == (100, "configured_interval")
    assert entry["net_seconds"] == pytest.approx(0.002 * 100 - 0.5, rel=1e-9)
    assert entry["break_even_steps"] == pytest.approx(250.0, rel=1e-9)
    assert entry["outcome"] == "did_not_pay"
    assert entry["balancedness_before"] == pytest.approx(0.6) and entry["balancedness_after"] == pytest.approx(0.85)
    assert entry["balancedness_changed_layers_before"] == pytest.approx(0.5)
    assert entry["balancedness_changed_layers_after"] == pytest.approx(0.9)
    assert entry["rebalanced_at"] == 1003.5 and entry["recorded"]["digest"] == "ab"


def test_the_horizon_is_the_steps_to_the_next_rebalance_once_it_has_come():
    ledger = Ledger(windows=3)
    windows = [{"steps": steps_of(0.010)}, {"steps": steps_of(0.010, stall=0.05), "records": [vllm_record([1], 2)]},
               {"steps": steps_of(0.005)}, {"steps": steps_of(0.005)},
               {"steps": steps_of(0.005), "records": [vllm_record([0], 2)]}]
    [first] = feed(ledger, windows)  # the second rebalance began before three windows came after the first
    assert first["windows"] == {"before": 1, "during": 1, "after": 2}
    assert (first["horizon_steps"], first["horizon"]) == (20, "next_rebalance")
    assert first["stall_seconds"] == pytest.approx(0.05, rel=1e-9)
    assert first["net_seconds"] == pytest.approx(0.005 * 20 - 0.05, rel=1e-9) and first["outcome"] == "paid"
    assert first["break_even_steps"] == pytest.approx(10.0, rel=1e-9)
    [second] = ledger.finish()  # the end of the recorded windows: measured on what there is
    assert not second["settled"] and second["windows"] == {"before": 2, "during": 1, "after": 0}
    assert second["gain_seconds_per_step"] is None and second["outcome"] == "unknown"


def test_steps_that_got_slower_never_break_even_and_a_faster_move_is_no_negative_stall():
    ledger = Ledger(windows=1)
    [entry] = feed(ledger, [{"steps": steps_of(0.010)}, {"steps": steps_of(0.009), "records": [vllm_record([0], 1)]},
                            {"steps": steps_of(0.012)}])
    assert entry["stall_seconds"] == 0.0
    assert entry["gain_seconds_per_step"] == pytest.approx(-0.002, rel=1e-9)
    assert entry["break_even_steps"] is None and entry["outcome"] == "did_not_pay"
    assert (entry["horizon_steps"], entry["horizon"]) == (10, "observed")


def test_the_agents_plan_is_placed_by_its_times_and_epochs_even_when_its_ack_comes_late():
    ledger = Ledger(windows=2)
    windows = [{"steps": steps_of(0.020)}, {"steps": steps_of(0.020)},
               {"steps": steps_of(0.020, stall=0.03)},  # still at epoch 0 while the weights moved
               {"steps": steps_of(0.015), "epoch": 1, "bal": [0.8, 0.9]}]
    assert feed(ledger, windows) == []
    # Sent while window 2 ran (it ends at 1003), acknowledged at its end; the Ack comes after window 3.
    plan = AppliedPlan(epoch=1, sent_at=1002.5, applied_at=1003.0, layers_changed=(1,), slots_moved=3,
                       bytes_moved=3e6, between_steps_stall_seconds=0.2, engine="moewatch-runtime")
    assert ledger.add_plan(plan) == []
    [entry] = ledger.add_window(1004.0, 1005.0, 1, STEPS, steps_of(0.015), np.array([0.8, 0.9]))
    assert entry["policy"] == "agent_plan" and entry["plan"]["epoch"] == 1 and entry["rebalanced_at"] == 1002.5
    assert entry["windows"] == {"before": 2, "during": 1, "after": 2}
    assert entry["stall_between_steps_seconds"] == 0.2
    assert entry["stall_seconds"] == pytest.approx(0.03 + 0.2, rel=1e-9)
    assert entry["gain_seconds_per_step"] == pytest.approx(0.005, rel=1e-9)
    assert (entry["horizon_steps"], entry["horizon"]) == (20, "observed")  # no interval for the agent's plans
    assert entry["net_seconds"] == pytest.approx(0.005 * 20 - 0.23, rel=1e-9) and entry["outcome"] == "did_not_pay"
    assert entry["break_even_steps"] == pytest.approx(46.0, rel=1e-9)
    assert entry["balancedness_changed_layers_before"] == pytest.approx(0.7)
    assert entry["balancedness_changed_layers_after"] == pytest.approx(0.9)


def test_itl_quantiles_are_the_slo_intervals_over_each_phase():
    ledger = Ledger(windows=1)
    slo = [SloInterval(1000.0, 1001.0, 0.010, 0.030), SloInterval(1001.0, 1002.0, 0.020, 0.090),
           SloInterval(1002.0, 1003.0, 0.008, 0.020)]
    [entry] = feed(ledger, [{"steps": steps_of(0.01), "slo": slo[0]},
                            {"steps": steps_of(0.01), "slo": slo[1], "records": [vllm_record([0], 1)]},
                            {"steps": steps_of(0.01), "slo": slo[2]}])
    assert (entry["itl_p50_seconds_before"], entry["itl_p99_seconds_before"]) == (0.010, 0.030)
    assert (entry["itl_p50_seconds_during"], entry["itl_p99_seconds_during"]) == (0.020, 0.090)
    assert (entry["itl_p50_seconds_after"], entry["itl_p99_seconds_after"]) == (0.008, 0.020)


def test_whose_policy_and_what_makes_no_entry():
    assert policy_label({"engine": "vllm", "policy": "engine"}) == "engine_own"
    assert policy_label({"engine": "sglang", "fallback": True, "error": "x"}) == "engine_own"
    assert policy_label({"engine": "vllm", "layer_outcomes": {"moved": 1}}) == "moewatch_in_engine"
    ledger = Ledger(windows=1)
    moewatch = {"engine": "sglang", "layer_outcomes": {"moved": 1}, "experts_moved": 5,
                "layers_by_reason": {"moved": [2], "kept: no load": [0, 1]}}
    settled = feed(ledger, [{"steps": None}, {"steps": None, "records": [
        vllm_record([], 0), "not a record", {"engine": 3}, moewatch]}, {"steps": None}])
    [entry] = settled  # the call that moved nothing and the malformed ones make none
    assert (entry["policy"], entry["engine"]) == ("moewatch_in_engine", "sglang") and entry["layers_changed"] == [2] and entry["slots_moved"] == 5
    # Windows without step times: nothing measured, nothing guessed.
    assert entry["stall_seconds"] is None and entry["gain_seconds_per_step"] is None
    assert entry["net_seconds"] is None and entry["outcome"] == "unknown"


def test_the_arithmetic():
    assert stall_seconds([0.6, 0.1], [10, 10], 0.01, between_steps=0.25) == pytest.approx(0.75)
    assert stall_seconds([0.1], [10], 0.02) == 0.0
    assert net_seconds(0.002, 300, 0.5) == pytest.approx(0.1)
    assert break_even_steps(0.5, 0.002) == pytest.approx(250)
    assert break_even_steps(0.5, 0.0) is None and break_even_steps(0.5, -1.0) is None
    with pytest.raises(ValueError, match="windows"):
        Ledger(windows=0)


def test_calls_in_one_window_are_one_rebalance_of_the_last_calls_policy():
    ledger = Ledger(windows=1)
    fallback = {"engine": "vllm", "fallback": True, "error": "RuntimeError: injected"}
    decided = {"engine": "vllm", "layer_outcomes": {"moved": 1}, "experts_moved": 4, "layers_by_reason": {"moved": [0]}}
    [both] = feed(ledger, [{"steps": steps_of(0.01)}, {"steps": steps_of(0.01), "records": [decided, fallback]},
                           {"steps": steps_of(0.01)}])
    assert both["policy"] == "engine_own" and both["calls"] == 2
    assert both["layers_changed"] is None and both["slots_moved"] is None  # the fallback's moves are not recorded
    ledger = Ledger(windows=1)
    [two] = feed(ledger, [{"steps": steps_of(0.01)}, {"steps": steps_of(0.01), "records": [
        vllm_record([0], 2), vllm_record([2], 3)]}, {"steps": steps_of(0.01)}])
    assert (two["layers_changed"], two["slots_moved"], two["bytes_moved"]) == ([0, 2], 5, 5000.0)
