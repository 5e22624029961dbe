"""Rank speed: the estimator alone (arrays in, no windows), the policy planning for a persistently slow
rank, and verification judging such a plan by time, never by its lower plain balancedness."""

from __future__ import annotations

import numpy as np
import pytest

from moewatch.agent import policy, verification
from moewatch.agent import rank_speed as rs
from moewatch.agent.config import AgentConfig
from moewatch.agent.params import from_config
from moewatch.agent.store import TriagedWindow
from moewatch.planner import placement_math as pm
from moewatch.thresholds import ConfigError
from moewatch.triage import diagnose

# No floor in seconds here: these tests count windows; the floor has its own test.
PARAMS = rs.RankSpeedParams(windows=3, min_seconds=0.0, min_pairs=100, slow_below=0.85, recover_above=0.95)


def fold(speeds, pairs=1000, params=PARAMS, seconds=1.0):
    """Windows of per-rank speeds [n][W] (pairs per compute second), each `seconds` long -> (final state,
    each window's change)."""
    state, changes = rs.RankSpeedState(), []
    for i, speed in enumerate(speeds):
        count = np.full(len(speed), pairs) if np.isscalar(pairs) else np.asarray(pairs[i])
        state, change = rs.observe(state, np.asarray(speed, dtype=float), count, seconds, params)
        changes.append(change)
    return state, changes


def transitions(changes):
    return [(i, "slow", r) for i, c in enumerate(changes) for r in c.became_slow] + \
        [(i, "recovered", r) for i, c in enumerate(changes) for r in c.recovered]


# --- the estimator ----------------------------------------------------------------------------------

def test_relative_speed_is_over_the_median_rank_and_needs_min_pairs():
    speed = np.array([100.0, 100.0, 50.0, 200.0])
    assert rs.relative_speeds(speed, np.full(4, 500), 100).tolist() == [1.0, 1.0, 0.5, 2.0]
    few = rs.relative_speeds(speed, np.array([500, 500, 50, 500]), 100)
    assert np.isnan(few[2]) and few[[0, 1, 3]].tolist() == [1.0, 1.0, 2.0]
    # One measured rank has nothing to be compared with.
    assert np.isnan(rs.relative_speeds(np.array([100.0, 50.0]), np.array([500, 5]), 100)).all()


def test_a_rank_is_slow_only_after_k_consecutive_slow_windows():
    slow = [100.0, 100.0, 100.0, 50.0]
    state, _ = fold([slow] * 2)
    assert not state.slow.any() and rs.planning_speeds(state) is None
    state, changes = fold([slow] * 3)
    assert state.slow_ranks == (3,) and changes[-1].became_slow == (3,)
    assert rs.planning_speeds(state) == pytest.approx([1.0, 1.0, 1.0, 0.5])
    # One fast window breaks the run: K in a row, not K of the last few.
    state, changes = fold([slow, slow, [100.0] * 4, slow, slow])
    assert not state.slow.any() and transitions(changes) == []


def test_a_state_change_also_needs_min_seconds_of_windows_in_a_row():
    """Eighth-of-a-second windows: K of them are not enough; the rank turns slow on the window that
    brings its run to min_seconds. The run follows the median over K windows: two fast windows in a
    row restart the clock, one fast window or one between the thresholds does not; recovery waits as
    long."""
    params = rs.RankSpeedParams(windows=3, min_seconds=2.5, min_pairs=100, slow_below=0.85, recover_above=0.95)
    slow, between, fast = [100.0, 50.0], [100.0, 90.0], [100.0, 100.0]

    def changes_of(speeds, seconds=0.125):
        return transitions(fold(speeds, params=params, seconds=seconds)[1])

    assert changes_of([slow] * 19) == []
    assert changes_of([slow] * 20) == [(19, "slow", 1)]
    assert changes_of([slow] * 15 + [fast] * 2 + [slow] * 20) == []
    assert changes_of([slow] * 15 + [fast] * 2 + [slow] * 21) == [(37, "slow", 1)]
    assert changes_of([slow] * 15 + [fast] + [slow] * 4) == [(19, "slow", 1)]
    assert changes_of([slow] * 10 + [between] + [slow] * 9) == [(19, "slow", 1)]
    # Back: the median turns fast on the second fast window, and the run counts from there.
    assert changes_of([slow] * 20 + [fast] * 10 + [between] + [fast] * 10) == [(19, "slow", 1), (40, "recovered", 1)]
    assert changes_of([slow] * 20 + [fast] * 10 + [slow] * 2 + [fast] * 21) == [(19, "slow", 1), (52, "recovered", 1)]
    # Long windows: K of them span the floor, and K is what counts again.
    assert changes_of([slow] * 3, seconds=1.0) == [(2, "slow", 1)]


def test_the_median_over_k_windows_shrugs_off_one_noisy_window():
    state, _ = fold([[100, 100, 100, 50], [100, 100, 100, 10], [100, 100, 100, 50]])
    assert state.relative_speed[3] == pytest.approx(0.5)
    assert state.pairs_per_second[3] == pytest.approx(50.0)
    assert state.relative_speed[:3] == pytest.approx([1.0, 1.0, 1.0])


def test_a_slow_rank_recovers_with_hysteresis_and_never_flaps():
    """Slow, then hovering between the thresholds (stays slow), then alternating across both (never K in
    a row: no change), then fast for K windows (recovered), then hovering and alternating again (stays
    recovered): exactly one change each way over 35 windows."""
    rank3 = ([50] * 3 + [90] * 5 + [97, 80] * 4 + [97] * 3 + [90] * 5 + [80, 100] * 4 + [88] * 3)
    state, changes = fold([[100, 100, 100, x] for x in rank3])
    assert transitions(changes) == [(2, "slow", 3), (18, "recovered", 3)]
    assert not state.slow.any() and rs.planning_speeds(state) is None


def test_a_slow_rank_given_fewer_pairs_keeps_its_speed_and_its_state():
    """After a plan for speeds the slow rank computes fewer pairs in less time: its pairs per second
    do not move, so the judgement that made the plan stands (measuring time instead would undo it)."""
    def rates(pairs, seconds):
        return np.asarray(pairs, float) / np.asarray(seconds, float)

    before = [rates([1000, 1000], [1.0, 2.0])] * 3
    after = [rates([1375, 625], [1.375, 1.25])] * 6  # the 5.5 / 2.5 split: times nearly equal
    state, changes = fold(before + after, pairs=[[1000, 1000]] * 3 + [[1375, 625]] * 6)
    assert transitions(changes) == [(2, "slow", 1)]
    assert state.relative_speed == pytest.approx([4 / 3, 2 / 3])


def test_an_unmeasured_rank_keeps_its_state_and_plans_as_typical():
    slow = [[100.0, 50.0]] * 3
    state, _ = fold(slow + [[100.0, 500.0]] * 4, pairs=[[1000, 1000]] * 3 + [[1000, 10]] * 4)
    assert state.slow_ranks == (1,)  # too few pairs to tell: no recovery on no evidence
    assert np.isnan(state.relative_speed[1]) and rs.planning_speeds(state)[1] == 1.0


def test_a_new_world_size_starts_afresh():
    state, _ = fold([[100.0, 50.0]] * 3)
    state, change = rs.observe(state, np.array([100.0, 100.0, 100.0]), np.full(3, 1000), 1.0, PARAMS)
    assert state.world_size == 3 and not state.slow.any() and change.recovered == ()


def test_the_thresholds_are_configuration_checked_once():
    cfg = AgentConfig.from_mapping(policy={"slow_rank_windows": 4, "slow_rank_min_pairs": 10,
                                           "slow_rank_below": 0.8, "slow_rank_recover_above": 0.9})
    assert from_config(cfg).rank_speed == rs.RankSpeedParams(windows=4, min_seconds=10.0, min_pairs=10, slow_below=0.8,
                                                             recover_above=0.9, replan_change=0.25)
    with pytest.raises(ConfigError, match=r"^policy\.slow_rank_below: 0\.95 must be under"):
        AgentConfig.from_mapping(policy={"slow_rank_below": 0.95, "slow_rank_recover_above": 0.9})
    with pytest.raises(ConfigError, match=r"^policy\.slow_rank_windows"):
        AgentConfig.from_mapping(policy={"slow_rank_windows": 0})
    with pytest.raises(ConfigError, match=r"^policy\.slow_rank_recover_above"):
        AgentConfig.from_mapping(policy={"slow_rank_recover_above": 1.5})


def test_time_balancedness_weighs_pairs_by_speed():
    load = np.array([[550.0, 250.0], [400.0, 400.0]])
    speed = np.array([4 / 3, 2 / 3])
    assert rs.time_balancedness(load, None) == pytest.approx([400 / 550, 1.0])
    assert rs.time_balancedness(load, speed) == pytest.approx([(412.5 + 375) / 2 / 412.5, 450 / 600])


# --- the policy and verification on windows --------------------------------------------------------

W, L, E, P = 2, 2, 8, 12
SLOW = (1.0, 2.0)  # rank 1 takes twice as long per pair
SPEEDS = np.array([4 / 3, 2 / 3])  # what the estimator measures of SLOW


def even_load():
    return np.full((L, E), 100)


def windows(helpers, pmap, n, slowdown=SLOW, epoch=0, start=1000.0):
    out = []
    for i in range(n):
        w = helpers.make_window(even_load(), pmap, W, epoch=epoch, start_time=start + 10 * i, rank_slowdown=slowdown)
        out.append(TriagedWindow(w, diagnose(w), 0.0))
    return out


def cfg(**sections):
    return from_config(AgentConfig.from_mapping({"policy": {"mode": "act", "persist_windows": 3}}, **sections))


def group_view(ws, **changes):
    base = dict(num_gpus=W, num_nodes=1, num_experts=E, num_slots=P, capabilities=frozenset({"plan", "capacity"}),
                windows=ws)
    return policy.GroupView(**{**base, **changes})


def test_the_windows_measure_what_the_estimator_needs(helpers):
    from moewatch import telemetry as tm

    w = windows(helpers, helpers.contiguous(L, E, P), 1)[0].window
    state, _ = rs.observe(rs.RankSpeedState(), tm.rank_speed(w), tm.rank_load(w).sum(axis=0), 1.0, PARAMS)
    assert state.relative_speed == pytest.approx(SPEEDS)


def test_the_planner_gets_rank_speeds_only_when_the_view_carries_them(helpers, monkeypatch):
    """The policy hands the planner the speeds of a persistently slow rank, and nothing otherwise (equal
    speeds: the planner's own even split)."""
    import types

    from moewatch.planner import solve

    calls = []

    def planner(load, num_gpus, num_slots, num_nodes, **kw):
        calls.append(kw.get("rank_speed"))
        return types.SimpleNamespace(physical_to_logical_map=kw["current"].copy())

    monkeypatch.setattr(solve, "solve_placement", planner)
    ws = windows(helpers, helpers.contiguous(L, E, P), 3)
    # Balanced pairs, a slow device: every layer is a candidate once a rank is slow, and none before.
    policy.decide(group_view(ws), cfg().policy, 0.0)
    unslowed = list(calls)
    calls.clear()
    proposal = policy.decide(group_view(ws, rank_speed=SPEEDS, slow_ranks=(1,)), cfg().policy, 0.0)
    assert all(c is None for c in unslowed)
    assert len(calls) == 1 and calls[0] == pytest.approx(SPEEDS.tolist())
    assert not proposal.has_plan  # the fake planner kept the map: nothing moves
    assert {d.result for d in proposal.decisions} == {"skipped"}


def test_a_plan_for_a_slow_rank_gives_it_fewer_pairs_and_is_verified_by_time(helpers):
    old = helpers.contiguous(L, E, P)
    before = windows(helpers, old, 3)
    c = cfg(verify={"windows": 3})
    proposal = policy.decide(group_view(before, rank_speed=SPEEDS, slow_ranks=(1,)), c.policy, 0.0)
    assert proposal.has_plan, [d.reason for d in proposal.decisions]
    new = proposal.physical_to_logical_map
    load = even_load().astype(float)
    pairs = pm.gpu_load(load, new, W)
    assert (pairs[:, 1] < pairs[:, 0]).all(), "the slow rank computes fewer pairs"
    d = next(d for d in proposal.decisions if d.result == "proposed")
    assert "for rank speeds 1.33/0.67 -> balancedness by time" in d.reason
    assert d.after["rank_speed"] == pytest.approx(SPEEDS.tolist(), abs=1e-3)
    assert d.after["model_balancedness"] > d.before["model_balancedness"]  # by time
    assert d.after["plain_balancedness"] < 0.9  # plain balancedness falls on purpose
    assert all(b.rank_speed is not None for b in proposal.baseline.values())
    # The new epoch on the same traffic, rank 1 still slow: plain balancedness fell far more than
    # rollback_balancedness_drop, but the step is faster: kept.
    after = windows(helpers, new, 3, epoch=1, start=2000.0)
    drop = c.verify.rollback_balancedness_drop
    assert all(t.diagnosis.layers[0].metrics["balancedness"] < 1.0 - drop for t in after)
    outcome = verification.verify(proposal.baseline, after, c.verify, W)
    assert outcome.status == "keep", outcome.reason
    n = outcome.numbers[0]
    assert n["layer_seconds_after"] < n["layer_seconds_old_map_same_load"]
    assert n["machine_speed"] == pytest.approx(1.0)
    # Judged as an even-split plan (no speeds in its baseline) the same windows would be rolled back:
    # the balancedness criterion is what a speed-aware plan must be kept from.
    plain = {layer: verification.make_baseline(before, layer, old[layer], 0.0, W) for layer in proposal.baseline}
    assert verification.verify(plain, after, c.verify, W).status == "rollback"


def test_a_plan_for_speeds_that_makes_the_layer_slower_is_rolled_back_by_time(helpers):
    """The speed-aware map, but the all-to-all got slow with it: time decides, and it rolls back."""
    old = helpers.contiguous(L, E, P)
    c = cfg(verify={"windows": 3, "rollback_time_rise": 0.25})
    proposal = policy.decide(group_view(windows(helpers, old, 3), rank_speed=SPEEDS, slow_ranks=(1,)), c.policy, 0.0)
    slow_path = []
    for i in range(3):
        w = helpers.make_window(even_load(), proposal.physical_to_logical_map, W, epoch=1, start_time=2000.0 + 10 * i,
                                rank_slowdown=SLOW, transfer_seconds=5e-3)
        slow_path.append(TriagedWindow(w, diagnose(w), 0.0))
    outcome = verification.verify(proposal.baseline, slow_path, c.verify, W)
    assert outcome.status == "rollback" and "expected with the old placement" in outcome.reason


def test_once_the_rank_recovers_the_policy_plans_back_to_even(helpers):
    """A placement made for speeds, every rank fast again: the view says so and the planner's equal-speed
    split comes back through the gate (plain balancedness rises)."""
    old = helpers.contiguous(L, E, P)
    proposal = policy.decide(group_view(windows(helpers, old, 3), rank_speed=SPEEDS, slow_ranks=(1,)), cfg().policy,
                             0.0)
    uneven = proposal.physical_to_logical_map
    recovered = windows(helpers, uneven, 3, slowdown=(1.0, 1.0), epoch=1, start=2000.0)
    back = policy.decide(group_view(recovered, placed_for_speeds=True), cfg().policy, 100.0)
    assert back.has_plan, [d.reason for d in back.decisions]
    load = even_load().astype(float)
    assert (pm.placement_balancedness(load, back.physical_to_logical_map, W) > 0.95).all()
    assert all(b.rank_speed is None for b in back.baseline.values())
    # Even again and nothing slow: no candidate without a verdict, so no further plan.
    even = windows(helpers, back.physical_to_logical_map, 3, slowdown=(1.0, 1.0), epoch=2, start=3000.0)
    assert not policy.decide(group_view(even), cfg().policy, 200.0).has_plan


# --- the controller: measured in every window, planned for only once persistent --------------------

def test_the_controller_plans_with_speeds_only_for_a_persistently_slow_rank(start_agent, helpers, monkeypatch):
    from moewatch.agent.audit import read_audit

    seen = []

    def planner(load, current, num_gpus, num_nodes, max_replicas, rank_speed=None):
        seen.append(None if rank_speed is None else [float(x) for x in rank_speed])
        return current.copy()

    monkeypatch.setattr(policy, "proposed_placement", planner)
    daemon = start_agent(policy={"mode": "act", "persist_windows": 2, "slow_rank_windows": 3,
                                 "slow_rank_min_seconds": 0})
    rt = helpers.FakeRuntime(daemon.cfg.server.socket, world_size=W).connect()
    group = helpers.wait_group(daemon)
    pmap = helpers.contiguous(L, E, P)

    def feed(n, slowdown, start):
        count = len(group.history)
        for i in range(n):
            rt.send(helpers.make_window(even_load(), pmap, W, start_time=start + 10 * i, rank_slowdown=slowdown))
        assert helpers.wait_for(lambda: len(group.history) == count + n)

    def tick():
        seen.clear()
        daemon.controller.plan_group(group)
        return list(seen)

    feed(2, SLOW, 1000.0)
    assert tick() and all(s is None for s in seen), "two slow windows of three: equal speeds"
    text = helpers.scrape(daemon.http_url)
    assert helpers.sample_value(text, "moewatch_rank_slow", rank="1") == 0
    assert helpers.sample_value(text, "moewatch_rank_relative_speed", rank="1") == pytest.approx(2 / 3, rel=1e-3)
    feed(1, SLOW, 1020.0)
    speeds = tick()
    assert speeds and all(s == pytest.approx(SPEEDS.tolist(), rel=1e-3) for s in speeds)
    assert daemon.controller.status(group.key)["slow_ranks"] == [1]
    assert helpers.wait_for(lambda: helpers.sample_value(helpers.scrape(daemon.http_url), "moewatch_rank_slow",
                                                         rank="1") == 1)
    # Fast again: K windows above the recovery threshold, then equal speeds.
    feed(3, (1.0, 1.0), 1030.0)
    assert all(s is None for s in tick())
    events = [r for r in read_audit(daemon.cfg.log.audit_log) if r["event"] in ("rank_slow", "rank_recovered")]
    assert [(r["event"], r["rank"]) for r in events] == [("rank_slow", 1), ("rank_recovered", 1)]
    assert events[0]["relative_speed"] == pytest.approx(2 / 3, rel=1e-3) and events[0]["pairs_per_second"] > 0
    assert helpers.sample_value(helpers.scrape(daemon.http_url), "moewatch_rank_slow", rank="1") == 0


def test_speeds_close_to_those_the_placement_was_made_for_keep_it():
    """Noise in the measured speeds must not move slots: within replan_change (25 %) of the speeds the
    placement in force was made for, those are planned for again (the planner re-finds that map)."""
    placed = np.array([1.33, 0.67])
    assert rs.steady_speeds(np.array([1.45, 0.55]), placed, PARAMS) is placed
    assert rs.steady_speeds(np.array([1.6, 0.4]), placed, PARAMS).tolist() == [1.6, 0.4]
    assert rs.steady_speeds(np.array([1.03, 0.97]), placed, PARAMS) is placed  # recovering: wait for it
    assert rs.steady_speeds(None, placed, PARAMS) is None  # no rank slow: equal speeds
    assert rs.steady_speeds(np.array([1.2, 0.8]), None, PARAMS).tolist() == [1.2, 0.8]
