"""The policy alone: windows in, decisions out (no sockets, no clocks)."""

from __future__ import annotations

import numpy as np
import pytest

from moewatch.agent import policy, verification
from moewatch.agent.config import AgentConfig
from moewatch.agent.params import from_config
from moewatch.agent.store import TriagedWindow
from moewatch.integrations import registry
from moewatch.integrations.reference.actuator import RuntimeActuator
from moewatch.planner import placement_math as pm
from moewatch.triage import diagnose

W, L, E, P = 4, 2, 8, 12


def cfg(**sections):
    """The decision parameters of a config in act mode with K = 3, each keyword a section over it."""
    return from_config(AgentConfig.from_mapping({"policy": {"mode": "act", "persist_windows": 3}}, **sections))


def triaged(helpers, load, pmap, n, epoch=0, start=1000.0, **kw):
    out = []
    for i in range(n):
        w = helpers.make_window(load, pmap, W, epoch=epoch, start_time=start + 10 * i, **kw)
        out.append(TriagedWindow(w, diagnose(w), 0.0))
    return out


def view(windows, **changes):
    base = dict(num_gpus=W, num_nodes=1, num_experts=E, num_slots=P, capabilities=frozenset({"plan", "capacity"}),
                windows=windows)
    return policy.GroupView(**{**base, **changes})


def test_hot_expert_is_replicated_and_balancedness_rises(helpers):
    load = helpers.hot_load(L, E, hot=0)
    pmap = helpers.contiguous(L, E, P)
    windows = triaged(helpers, load, pmap, 3)
    assert all(d.verdict == "imbalance-bound" for d in windows[-1].diagnosis.layers)
    proposal = policy.decide(view(windows), cfg().policy, now=0.0)
    assert proposal.has_plan
    assert set(proposal.changed_layers) == {0, 1}
    assert {d.kind for d in proposal.decisions} == {"replicate"}
    counts = pm.replica_counts_of(proposal.physical_to_logical_map, E)
    assert (counts[:, 0] > 1).all(), "the hot expert got replicas"
    assert (counts <= 4).all()
    before = pm.placement_balancedness(load.astype(float), pmap, W)
    after = pm.placement_balancedness(load.astype(float), proposal.physical_to_logical_map, W)
    assert (after > before + 0.1).all()
    # The decision carries its numbers, before and after.
    d = proposal.decisions[0]
    assert d.after["model_balancedness"] > d.before["model_balancedness"]
    assert d.after["slots_moved"] > 0 and d.after["predicted_stall_seconds"] > 0
    # A whole plan: the other layers keep their maps, the capacity factors stay.
    assert proposal.capacity_factor.tolist() == [0.0] * L


def test_observe_mode_and_short_evidence_decide_nothing(helpers):
    windows = triaged(helpers, helpers.hot_load(L, E), helpers.contiguous(L, E, P), 3)
    assert policy.decide(view(windows), cfg(policy={"mode": "observe"}).policy, 0.0).decisions == []
    assert policy.decide(view(windows[:2]), cfg().policy, 0.0).decisions == []


def test_verdict_must_persist_k_windows(helpers):
    pmap = helpers.contiguous(L, E, P)
    healthy = triaged(helpers, np.full((L, E), 200), pmap, 1)
    hot = triaged(helpers, helpers.hot_load(L, E), pmap, 2, start=2000.0)
    assert healthy[0].diagnosis.layers[0].verdict == "healthy"
    assert not policy.decide(view(healthy + hot), cfg().policy, 0.0).has_plan
    assert policy.decide(view(healthy + hot), cfg(policy={"persist_windows": 2}).policy, 0.0).has_plan


def test_cost_gate_skips_what_does_not_pay(helpers):
    windows = triaged(helpers, helpers.hot_load(L, E), helpers.contiguous(L, E, P), 3)
    # Huge experts over a slow link: the stall outweighs any gain over a short horizon.
    proposal = policy.decide(view(windows), cfg(cost={"expert_bytes": 10**12}, policy={"horizon_seconds": 10}).policy,
                             0.0)
    assert not proposal.has_plan
    assert proposal.decisions and all(d.result == "skipped" for d in proposal.decisions)
    assert all("does not pay" in d.reason for d in proposal.decisions)
    d = proposal.decisions[0]
    assert d.after["predicted_gain_seconds"] < d.after["predicted_stall_seconds"]


def test_cooldown_and_rate_limit(helpers):
    windows = triaged(helpers, helpers.hot_load(L, E), helpers.contiguous(L, E, P), 3)
    cooled = policy.decide(view(windows, last_change={0: 100.0}), cfg(policy={"cooldown_seconds": 300}).policy,
                           now=200.0)
    assert cooled.changed_layers == (1,)
    skipped = [d for d in cooled.decisions if d.result == "skipped"]
    assert skipped and skipped[0].layers == (0,) and "cooldown" in skipped[0].reason
    limited = policy.decide(view(windows, plan_times=(100.0, 150.0)), cfg(policy={"max_plans_per_hour": 2}).policy,
                            now=200.0)
    assert not limited.has_plan
    assert all(d.result == "skipped" and "rate limit" in d.reason for d in limited.decisions)


def test_recommend_mode_recommends(helpers):
    windows = triaged(helpers, helpers.hot_load(L, E), helpers.contiguous(L, E, P), 3)
    proposal = policy.decide(view(windows), cfg(policy={"mode": "recommend"}).policy, 0.0)
    assert {d.result for d in proposal.decisions} == {"recommended"}


def test_no_plan_capability_means_skipped(helpers):
    windows = triaged(helpers, helpers.hot_load(L, E), helpers.contiguous(L, E, P), 3)
    proposal = policy.decide(view(windows, capabilities=frozenset()), cfg().policy, 0.0)
    assert not proposal.has_plan
    assert all("does not apply placement plans" in d.reason for d in proposal.decisions)


def test_max_replicas_per_expert_is_respected(helpers):
    load = helpers.hot_load(1, E, hot_pairs=5000)
    windows = triaged(helpers, load, helpers.contiguous(1, E, P), 3)
    proposal = policy.decide(view(windows), cfg(policy={"max_replicas_per_expert": 2}).policy, 0.0)
    assert proposal.has_plan
    assert pm.replica_counts_of(proposal.physical_to_logical_map, E).max() == 2


def test_capacity_raise_is_bounded(helpers):
    from moewatch.tools.examples import scenario, simulate

    s = scenario("overflow", world_size=4, num_experts=8, num_layers=2)
    windows = [TriagedWindow(w, diagnose(w), 0.0) for w in
               (simulate(s, seed=i, start_time=1000.0 + 10 * i) for i in range(3))]
    assert all(d.overflow for d in windows[-1].diagnosis.layers)
    v = view(windows, num_experts=8, num_slots=8)
    proposal = policy.decide(v, cfg(policy={"capacity_factor_max": 1.5}).policy, 0.0)
    caps = [d for d in proposal.decisions if d.kind == "capacity"]
    assert caps and all(d.result == "proposed" for d in caps)
    assert proposal.capacity_factor.max() <= 1.5
    assert (proposal.capacity_factor > 1.25).all()
    at_bound = policy.decide(v, cfg(policy={"capacity_factor_max": 1.25}).policy, 0.0)
    assert all(d.result == "skipped" and "bound" in d.reason for d in at_bound.decisions if d.kind == "capacity")


def test_capacity_raise_is_the_per_step_solve_over_the_evidence_windows():
    from moewatch.capacity import capacity_for_windows
    from moewatch.tools.examples import scenario, simulate

    s = scenario("overflow", world_size=4, num_experts=8, num_layers=2)
    windows = [TriagedWindow(w, diagnose(w), 0.0) for w in
               (simulate(s, seed=i, start_time=1000.0 + 10 * i) for i in range(3))]
    c = cfg(policy={"capacity_factor_max": 8.0})
    proposal = policy.decide(view(windows, num_experts=8, num_slots=8), c.policy, 0.0)
    wanted = [capacity_for_windows([e.window for e in windows], layer, c.policy.overflow_target)
              for layer in range(2)]
    expected = [min(max(x, c.policy.capacity_factor_min), c.policy.max_capacity_factor) for x in wanted]
    assert proposal.capacity_factor.tolist() == pytest.approx(expected)


def test_verify_keeps_a_good_plan_and_rolls_back_a_bad_one(helpers):
    load = helpers.hot_load(L, E)
    old = helpers.contiguous(L, E, P)
    before = triaged(helpers, load, old, 3)
    c = cfg(verify={"windows": 2})
    proposal = policy.decide(view(before), c.policy, 0.0)
    # Verification needs at least MIN_VERIFY_WINDOWS (3) windows, whatever verify_windows says.
    good = triaged(helpers, load, proposal.physical_to_logical_map, 3, epoch=1, start=2000.0)
    assert verification.verify(proposal.baseline, good[:2], c.verify, W).status == "wait"
    kept = verification.verify(proposal.baseline, good, c.verify, W)
    assert kept.status == "keep", kept.reason
    # A bad plan: the hot expert and the next busiest all on GPU 0 (slots 0-2).
    bad_map = old.copy()
    bad_map[0, :3] = [0, 0, 0]
    bad_map[0, 3:] = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    bad = triaged(helpers, load, bad_map, 3, epoch=1, start=2000.0)
    outcome = verification.verify(proposal.baseline, bad, c.verify, W)
    assert outcome.status == "rollback"
    assert 0 in outcome.worse_layers
    numbers = outcome.numbers[0]
    drop = c.verify.rollback_balancedness_drop
    assert numbers["balancedness_after"] < numbers["balancedness_old_map_same_load"] - drop


def test_verify_is_robust_to_load_drift(helpers):
    """The hot expert moves after the change: balancedness falls, but no worse than the old map would."""
    old = helpers.contiguous(L, E, P)
    c = cfg(verify={"windows": 2})
    proposal = policy.decide(view(triaged(helpers, helpers.hot_load(L, E, hot=0), old, 3)), c.policy, 0.0)
    drifted = triaged(helpers, helpers.hot_load(L, E, hot=5), proposal.physical_to_logical_map, 3, epoch=1,
                      start=2000.0)
    assert np.mean([d.metrics["balancedness"] for d in drifted[-1].diagnosis.layers]) < 0.9
    assert verification.verify(proposal.baseline, drifted, c.verify, W).status == "keep"


def test_verify_rolls_back_a_layer_that_got_slower(helpers):
    """Better balanced but slower per step than the old map would be (say, the new placement's traffic
    takes a slow path): rolled back on time."""
    load = helpers.hot_load(L, E)
    c = cfg(verify={"windows": 2, "rollback_time_rise": 0.25})
    proposal = policy.decide(view(triaged(helpers, load, helpers.contiguous(L, E, P), 3)), c.policy, 0.0)
    same = triaged(helpers, load, proposal.physical_to_logical_map, 3, epoch=1, start=2000.0)
    assert verification.verify(proposal.baseline, same, c.verify, W).status == "keep"
    slow = triaged(helpers, load, proposal.physical_to_logical_map, 3, epoch=1, start=2000.0,
                   transfer_seconds=2e-3)
    outcome = verification.verify(proposal.baseline, slow, c.verify, W)
    assert outcome.status == "rollback" and "expected with the old placement" in outcome.reason
    n = outcome.numbers[0]
    assert n["layer_seconds_after"] > n["layer_seconds_old_map_same_load"] * 1.25


def test_every_skipped_decision_carries_numbers(helpers):
    windows = triaged(helpers, helpers.hot_load(L, E), helpers.contiguous(L, E, P), 3)
    for proposal in (policy.decide(view(windows, last_change={0: 100.0, 1: 100.0}), cfg().policy, now=150.0),
                     policy.decide(view(windows, capabilities=frozenset()), cfg().policy, 0.0),
                     policy.decide(view(windows), cfg(cost={"expert_bytes": 10**12},
                                                      policy={"horizon_seconds": 10}).policy, 0.0)):
        assert proposal.decisions and all(d.result == "skipped" for d in proposal.decisions)
        assert all(d.before.get("balancedness", d.before.get("model_balancedness")) is not None
                   for d in proposal.decisions)


def test_the_readme_and_the_vllm_reason_say_moewatchs_policy_runs_inside_vllms_eplb():
    # "vLLM takes no placement from outside" stopped being true with the EPLB policy: the agent sends
    # no plan, but the placements vLLM's EPLB moves to are moewatch's when the switch is on.
    from pathlib import Path

    from moewatch.planner.rebalance import SWITCH

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## vLLM and transformers", 1)[1].split("\n## ", 1)[0]
    assert SWITCH in section and "no placement from outside" not in section
    assert SWITCH in registry.get("vllm").observe_only.observe_only_reason


def test_a_vllm_source_gets_recommendations_never_a_plan(helpers):
    # vLLM takes no plan from the agent: even in act mode the agent only says what it would change.
    windows = [TriagedWindow(t.window.replace(runtime="vllm"), t.diagnosis, t.received_at)
               for t in triaged(helpers, helpers.hot_load(L, E), helpers.contiguous(L, E, P), 3)]
    vllm = registry.properties_for("vllm", RuntimeActuator(lambda key: None))
    proposal = policy.decide(view(windows, capabilities=frozenset(), actuator=vllm), cfg(policy={"mode": "act"}).policy,
                             0.0)
    assert not proposal.has_plan
    assert {d.result for d in proposal.decisions} == {"recommended"}
    assert {d.kind for d in proposal.decisions} == {"replicate"}
    assert all("vLLM takes no plan from the agent" in d.reason for d in proposal.decisions)
    assert policy.decide(view(windows, actuator=vllm), cfg(policy={"mode": "observe"}).policy, 0.0).decisions == []


def test_rank_totals_alone_give_no_plan_and_say_why(helpers):
    from moewatch.tools.examples import without_evidence
    from moewatch.telemetry import OPTIONAL_ARRAYS

    strip = (OPTIONAL_ARRAYS - {"rank_tokens"}) | {"expert_tokens"}
    full = triaged(helpers, helpers.hot_load(L, E), helpers.contiguous(L, E, P), 3)
    windows = [TriagedWindow(rank, diagnose(rank), 0.0) for rank in (without_evidence(t.window, strip) for t in full)]
    assert all(d.verdict == "imbalance-bound" and d.cause is None for d in windows[-1].diagnosis.layers)
    for mode in ("act", "recommend"):
        proposal = policy.decide(view(windows), cfg(policy={"mode": mode}).policy, 0.0)
        assert not proposal.has_plan and {d.layers for d in proposal.decisions} == {(0,), (1,)}
        assert all(d.result == "skipped" and "no plan" in d.reason and "expert_tokens" in d.reason
                   and d.before["hot_experts"] is None for d in proposal.decisions)

# --- verification that noise cannot fool ------------------------------------------------------------

def _neutral_change(helpers):
    """A baseline for layer 0 and a plan that neither helps nor hurts it: two slots of one GPU swapped."""
    load = helpers.hot_load(L, E)
    old = helpers.contiguous(L, E, P)
    before = triaged(helpers, load, old, 3)
    new = old.copy()
    new[0, [0, 1]] = new[0, [1, 0]]
    baseline = {0: verification.make_baseline(before, 0, old[0], 0.0, W)}
    return load, new, baseline


def _windows(helpers, load, pmap, speeds, start=2000.0, **kw):
    """Windows of the new epoch whose machine computes at 1/speed of the usual rate (shared cores)."""
    out = []
    for i, slow in enumerate(speeds):
        w = helpers.make_window(load, pmap, W, epoch=1, start_time=start + 10 * i, seconds_per_pair=2e-6 * slow,
                                transfer_seconds=5e-5 * slow, **kw)
        out.append(TriagedWindow(w, diagnose(w), 0.0))
    return out


def test_one_noisy_window_does_not_roll_back_a_plan(helpers):
    """One window in three twice as slow (a burst of other work): the mean would say +33 %, the median
    says nothing changed."""
    load, new, baseline = _neutral_change(helpers)
    c = cfg(verify={"windows": 3, "rollback_time_rise": 0.25})
    outcome = verification.verify(baseline, _windows(helpers, load, new, [1.0, 2.0, 1.0]), c.verify, W)
    assert outcome.status == "keep", outcome.reason


def test_a_machine_wide_slowdown_is_not_blamed_on_the_plan(helpers):
    """Every window 60 % slower, compute and transfers alike: the control (old map, same traffic) is
    scaled by how fast the machine now computes a pair."""
    load, new, baseline = _neutral_change(helpers)
    c = cfg(verify={"windows": 3, "rollback_time_rise": 0.25})
    outcome = verification.verify(baseline, _windows(helpers, load, new, [1.6, 1.6, 1.6]), c.verify, W)
    assert outcome.status == "keep", outcome.reason
    assert outcome.numbers[0]["machine_speed"] == pytest.approx(1.6)


def test_a_regression_must_persist_in_every_window_to_roll_back(helpers):
    """Slow transfers (the plan's fault, compute unchanged) in two windows of three: wait; once three in
    a row are slow: roll back. Alternating forever: kept after the patience runs out."""
    load, new, baseline = _neutral_change(helpers)
    c = cfg(verify={"windows": 3, "rollback_time_rise": 0.25})

    def mixed(pattern):
        out = []
        for i, slow in enumerate(pattern):
            w = helpers.make_window(load, new, W, epoch=1, start_time=2000.0 + 10 * i,
                                    transfer_seconds=2e-3 if slow else 5e-5)
            out.append(TriagedWindow(w, diagnose(w), 0.0))
        return out

    assert verification.verify(baseline, mixed([1, 0, 1]), c.verify, W).status == "wait"
    assert verification.verify(baseline, mixed([1, 0, 1, 1]), c.verify, W).status == "wait"
    outcome = verification.verify(baseline, mixed([1, 0, 1, 1, 1]), c.verify, W)
    assert outcome.status == "rollback" and outcome.worse_layers == (0,) and "each slower" in outcome.reason
    kept = verification.verify(baseline, mixed([1, 0, 1, 0, 1, 0, 1, 0, 1]), c.verify, W)
    assert kept.status == "keep" and "never in 3 in a row" in kept.reason


def test_a_deliberately_bad_plan_is_rolled_back_through_noise(helpers):
    """The hot expert and the next busiest crowded onto GPU 0, windows at three machine speeds: the
    balancedness against the old map on the same traffic does not depend on speed, so it rolls back."""
    load = helpers.hot_load(L, E)
    old = helpers.contiguous(L, E, P)
    c = cfg(verify={"windows": 3})
    proposal = policy.decide(view(triaged(helpers, load, old, 3)), c.policy, 0.0)
    bad_map = old.copy()
    bad_map[0, :3] = [0, 0, 0]
    bad_map[0, 3:] = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    outcome = verification.verify(proposal.baseline, _windows(helpers, load, bad_map, [0.7, 1.8, 1.0]), c.verify, W)
    assert outcome.status == "rollback" and 0 in outcome.worse_layers
    n = outcome.numbers[0]
    assert n["balancedness_after"] < n["balancedness_old_map_same_load"] - c.verify.rollback_balancedness_drop


def test_absent_evidence_never_reads_as_a_regression(helpers):
    """A source that cannot measure rank loads or timings leaves them out: verification keeps the plan
    rather than comparing numbers that are not there."""
    load, new, baseline = _neutral_change(helpers)
    windows = _windows(helpers, load, new, [1.0, 1.0, 1.0])
    for t in windows:
        for key in ("balancedness", "layer_seconds_per_step", "compute_seconds_per_step"):
            t.diagnosis.layers[0].metrics[key] = None
    outcome = verification.verify(baseline, windows, cfg(verify={"windows": 3}).verify, W)
    assert outcome.status == "keep"
    assert np.isnan(outcome.numbers[0]["balancedness_after"]) and np.isnan(outcome.numbers[0]["layer_seconds_after"])


def test_the_policy_and_verification_take_parameters_not_the_config():
    import subprocess
    import sys

    code = ("import sys, moewatch.agent.policy, moewatch.agent.verification; "
            "print(sorted(m for m in sys.modules if m.startswith('moewatch.agent.') and m.rsplit('.', 1)[1] in "
            "('config', 'params')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    params = cfg(policy={"max_replicas_per_expert": 2}, verify={"windows": 4})
    assert isinstance(params.policy, policy.PolicyParams) and params.policy.max_replicas_per_expert == 2
    assert isinstance(params.verify, verification.VerifyParams) and params.verify.windows == 4
    with pytest.raises(Exception):
        params.policy.mode = "observe"
