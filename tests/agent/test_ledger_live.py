"""End to end on the reference runtime: the agent in act mode plans for two hot experts that start on rank
0 of two gloo ranks, each pinned to its own core (the launcher's core_binding); the plan moves weights
between steps and is acknowledged with the runtime's measured wait. The rebalance ledger then settles
the agent's plan as a rebalance: in the audit log (rebalance_ledger) and on /metrics, with the stall and
gain measured on the agent's own windows (recomputed here from the windows the agent kept), the slots
the plan moved, and the balancedness measured before and after."""

from __future__ import annotations

import os

import numpy as np
import pytest

from moewatch.agent.audit import read_audit

WINDOWS = 3  # verify.windows: the ledger's windows before and after
RUNTIME = ["--ranks", "2", "--layers", "4", "--experts", "8", "--slots", "12", "--top-k", "2", "--hidden", "128",
           "--ffn", "512", "--batch-tokens", "1024", "--zipf", "0", "--hot-experts", "2", "--hot-share", "0.7",
           "--hot-on-rank", "0", "--window-steps", "8", "--warmup-steps", "2", "--steps", "0", "--seconds", "150",
           "--seed", "1", "--json"]
EXPERT_BYTES = 3 * 128 * 512 * 4  # three hidden x ffn float32 matrices


def ledger_lines(daemon, policy: str) -> list[dict]:
    daemon.audit.sync()
    return [r for r in read_audit(daemon.cfg.log.audit_log) if r["event"] == "rebalance_ledger" and r["policy"] == policy]


def pace(windows) -> float:
    return sum(float(np.sum(t.window.step_seconds)) for t in windows) / sum(t.window.steps for t in windows)


@pytest.mark.slow
def test_the_agents_plan_is_a_rebalance_in_the_ledger_with_its_stall_and_gain_measured(start_agent, helpers):
    agent = start_agent(policy={"mode": "act", "persist_windows": 2, "cooldown_seconds": 3600,
                                "max_plans_per_hour": 100},
                        jobs={"plan_interval_seconds": 0.3}, verify={"windows": WINDOWS},
                        history={"windows": 512},
                        cost={"expert_bytes": EXPERT_BYTES, "migration_bandwidth_bytes_per_second": 1e9})
    runtime = helpers.start_runtime(agent.cfg.server.socket, *RUNTIME)
    try:
        group = helpers.wait_group(agent, ("moewatch-ref", "ep0"), timeout=60)
        assert helpers.wait_for(lambda: ledger_lines(agent, "agent_plan"), timeout=90), \
            helpers.audit_trail(agent.cfg.log.audit_log)
        windows = group.recent()
        exposition = helpers.scrape(agent.http_url)
    finally:
        result = helpers.stop_runtime(runtime)
    assert result["pairs_lost"] == 0
    binding = result["cpu_binding"]
    assert binding["pinned"] == (len(os.sched_getaffinity(0)) >= 2)

    entry = ledger_lines(agent, "agent_plan")[0]
    events = read_audit(agent.cfg.log.audit_log)
    [applied] = [r for r in events if r["event"] == "plan_applied" and r["epoch"] == entry["plan"]["epoch"]]
    assert entry["engine"] == "moewatch-runtime" and entry["settled"]
    assert entry["layers_changed"] == applied["layers"] and entry["slots_moved"] == applied["slots_moved"] > 0
    assert entry["bytes_moved"] == applied["slots_moved"] * EXPERT_BYTES
    # The stall: the runtime's measured wait between steps (the Ack's), plus what the steps of the windows
    # the weights moved in took beyond the pace before.
    assert entry["stall_between_steps_seconds"] == applied["stall_seconds"] > 0
    plan = entry["plan"]
    before = [t for t in windows if t.window.end_time <= plan["sent_at"]][-WINDOWS:]
    during = [t for t in windows if t.window.end_time > plan["sent_at"] and t.window.epoch < plan["epoch"]]
    after = [t for t in windows if t.window.epoch >= plan["epoch"]][:WINDOWS]
    assert entry["windows"] == {"before": len(before), "during": len(during), "after": WINDOWS}
    assert before, "the plan came before any window"
    extra = sum(float(np.sum(t.window.step_seconds)) - t.window.steps * pace(before) for t in during)
    assert entry["stall_seconds"] == pytest.approx(max(0.0, extra) + applied["stall_seconds"], rel=1e-9)
    gain = pace(before) - pace(after)
    assert entry["gain_seconds_per_step"] == pytest.approx(gain, rel=1e-9)
    assert entry["net_seconds"] == pytest.approx(gain * entry["horizon_steps"] - entry["stall_seconds"], rel=1e-9)
    assert entry["outcome"] == ("paid" if entry["net_seconds"] > 0 else "did_not_pay")
    # The hot experts spread over both ranks: measured balancedness rises.
    assert entry["balancedness_after"] > entry["balancedness_before"]
    # On /metrics, the same figures.
    labels = {"model": "moewatch-ref", "ep_group": "ep0", "policy": "agent_plan"}
    for name, key in (("moewatch_rebalance_ledger_stall_seconds", "stall_seconds"),
                      ("moewatch_rebalance_ledger_gain_per_step_seconds", "gain_seconds_per_step"),
                      ("moewatch_rebalance_ledger_net_seconds", "net_seconds")):
        assert helpers.sample_value(exposition, name, **labels) == pytest.approx(entry[key], rel=1e-6), name
    assert helpers.sample_value(exposition, "moewatch_rebalance_ledger_entries_total", outcome=entry["outcome"],
                                **labels) >= 1
