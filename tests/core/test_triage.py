"""Every verdict path of the documented order, on windows whose verdict follows by hand."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moewatch import telemetry as tm
from moewatch.tools.examples import SCENARIOS, simulate
from moewatch.thresholds import Thresholds
from moewatch.capacity import mean_load_capacities, mean_load_overflow_rates
from moewatch.triage import diagnose, pack_max_loads

W = 4


def verdict_of(window, **thresholds):
    d = diagnose(window, Thresholds(**thresholds)).layers[0]
    return d.verdict, d.cause, d.overflow, d


def test_healthy_when_compute_dominates_and_ranks_balance(hand):
    # share = 0.8 / 4.8 = 0.17 < 0.5; loads 4000 each.
    w = hand.window(hand.uniform(W, 1000), [0.1] * W, [0.1] * W, [1.0] * W)
    verdict, cause, overflow, d = verdict_of(w)
    assert (verdict, cause, overflow) == ("healthy", None, False)
    assert d.metrics["a2a_share"] == pytest.approx(0.8 / 4.8)
    assert d.actions == []


def test_comm_bound_volume_when_balanced_and_traffic_as_predicted(hand):
    # share = 4 / 6 = 0.67; balanced; cross 0.75 equals the prediction 1 - 1/4; messages 8 MB.
    w = hand.window(hand.uniform(W, 1000), [0.5] * W, [0.5] * W, [0.5] * W)
    verdict, cause, _, d = verdict_of(w)
    assert (verdict, cause) == ("comm-bound", "volume")
    assert d.metrics["cross_rank_ratio"] == pytest.approx(0.75)
    assert d.metrics["expected_cross_rank_ratio"] == pytest.approx(0.75)
    assert d.actions[0].kind == "replicate"


def test_comm_bound_small_batch_when_messages_are_tiny(hand):
    # One pair per rank pair: 8192-byte messages, under the seed's 32 KB.
    w = hand.window(hand.uniform(W, 1), [0.5] * W, [0.5] * W, [0.5] * W)
    verdict, cause, _, d = verdict_of(w)
    assert (verdict, cause) == ("comm-bound", "small-batch")
    assert d.metrics["mean_message_bytes"] == pytest.approx(8192)
    assert d.actions[0].kind == "batch"


def test_small_batch_threshold_is_configurable(hand):
    w = hand.window(hand.uniform(W, 1), [0.5] * W, [0.5] * W, [0.5] * W)
    assert verdict_of(w, small_message_bytes=4096)[:2] == ("comm-bound", "volume")


def test_comm_bound_placement_when_every_token_leaves_its_rank(hand):
    # Rank r's tokens all go to rank r+1's expert: balanced load, cross 100 % against 75 % predicted.
    traffic = np.roll(np.eye(W, dtype=np.int64) * 1000, 1, axis=1)
    w = hand.window(traffic, [0.5] * W, [0.5] * W, [0.5] * W)
    verdict, cause, _, d = verdict_of(w)
    assert (verdict, cause) == ("comm-bound", "placement")
    assert d.metrics["cross_rank_ratio"] == pytest.approx(1.0)
    assert d.actions[0].kind == "placement"


def test_high_share_with_dispersion_is_imbalance_not_volume(hand):
    # Expert 0 (rank 0) gets 4000 pairs from every rank, the others 500: rank 0 computes 1.6 s while
    # the rest wait inside the combine. Share = 5.8 / 8 = 0.725, above 0.5, yet the order's second
    # step (dispersion) sees the straggler: imbalance-bound with a hot expert, not comm-bound.
    traffic = np.full((W, W), 500, dtype=np.int64)
    traffic[:, 0] = 4000
    w = hand.window(traffic, [0.2] * W, [0.2, 1.6, 1.6, 1.6], [1.6, 0.2, 0.2, 0.2])
    verdict, cause, _, d = verdict_of(w)
    assert d.metrics["a2a_share"] == pytest.approx(5.8 / 8)
    assert (verdict, cause) == ("imbalance-bound", "hot-experts")
    assert d.metrics["hot_experts"] == [0]
    assert d.metrics["busiest_rank"] == 0
    first = d.actions[0]
    assert first.kind == "replicate" and first.params["experts"] == [0]
    assert first.predicted_gain > 0.3


def test_imbalance_without_hot_experts_is_a_straggler(hand):
    # Rank 0 carries 1.5x the mean (over the 1.3 max/mean threshold) but no expert reaches 2x the mean.
    traffic = np.full((W, W), 250, dtype=np.int64)
    traffic[:, 0] = 450
    verdict, cause, _, d = verdict_of(hand.window(traffic, [0.1] * W, [0.1] * W, [1.0] * W))
    assert d.metrics["rank_load_max_mean"] == pytest.approx(1800 / 1200)
    assert d.metrics["hot_experts"] == []
    assert (verdict, cause) == ("imbalance-bound", "straggler")


def test_slow_device_at_even_load_is_a_straggler(hand):
    # Balanced pairs, rank 0's compute takes 2 s against 1 s: compute max/mean 1.6; share 3.8/8.8 < 0.5.
    w = hand.window(hand.uniform(W, 1000), [0.1] * W, [0.1, 1.1, 1.1, 1.1], [2.0, 1.0, 1.0, 1.0])
    verdict, cause, _, d = verdict_of(w)
    assert d.metrics["a2a_share"] < 0.5
    assert (verdict, cause) == ("imbalance-bound", "straggler")
    assert d.actions[0].kind == "placement" and d.actions[0].predicted_gain > 0.1


def test_overflow_flag_and_capacity_action(hand):
    # 500 of 4500 pairs routed to expert 0 were dropped: 11 % overflow, over the 5 % threshold.
    w = hand.window(hand.uniform(W, 250), [0.1] * W, [0.1] * W, [1.0] * W, dropped=[500, 0, 0, 0],
                    capacity_factor=1.0)
    verdict, cause, overflow, d = verdict_of(w)
    assert overflow and verdict == "healthy"
    assert d.metrics["overflow_rate"] == pytest.approx(500 / 4500)
    capacity = [a for a in d.actions if a.kind == "capacity"]
    assert capacity and capacity[0].params["value"] > 1.0
    assert capacity[0].params["predicted_overflow"] <= 0.01 + 1e-9


def test_idle_layer_is_healthy_and_says_why(hand):
    w = hand.window(np.zeros((W, W), dtype=np.int64), [0.0] * W, [0.0] * W, [0.0] * W, step_tokens=[0])
    verdict, cause, overflow, d = verdict_of(w)
    assert (verdict, cause, overflow) == ("healthy", None, False)
    assert "no pairs" in d.evidence[0]


def test_lossy_capacity_never_outranks_lossless_actions(hand):
    traffic = np.full((W, W), 500, dtype=np.int64)
    traffic[:, 0] = 4000
    d = verdict_of(hand.window(traffic, [0.2] * W, [0.2, 1.6, 1.6, 1.6], [1.6, 0.2, 0.2, 0.2]))[3]
    kinds = [a.kind for a in d.actions]
    assert "capacity" in kinds and kinds[-1] == "capacity"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_simulated_scenarios_get_their_intended_verdict(name):
    s = SCENARIOS[name]
    result = diagnose(simulate(s, seed=7))
    for layer in result.layers:
        assert (layer.verdict, layer.cause, layer.overflow) == (s.intended_verdict, s.intended_cause,
                                                                 s.intended_overflow), layer.evidence


def test_summary_ranks_unhealthy_layers_first_and_names_the_slowest_rank():
    w = simulate(SCENARIOS["imbalance-hot-experts"], seed=3)
    result = diagnose(w)
    assert result.summary["slowest_rank"]["rank"] == 0  # experts 1-3 live on rank 0
    assert sorted(h["expert"] for h in result.summary["hot_experts_across_layers"]) == [1, 2, 3]
    assert all(h["layers"] == w.num_layers for h in result.summary["hot_experts_across_layers"])
    assert result.summary["verdicts"]["imbalance-bound"] == w.num_layers


# --- estimates behind the gains ---------------------------------------------------------------

def test_capacity_for_overflow_solves_the_overflow_equation():
    load = np.array([[100.0, 40, 30, 30]])  # mean 50
    c = mean_load_capacities(load, 0.05)  # budget 10 pairs: cap at 90 -> C = 1.8
    assert c == pytest.approx([1.8])
    assert mean_load_overflow_rates(load, c) == pytest.approx([0.05])
    assert mean_load_capacities(load, 0.0) == pytest.approx([2.0])
    assert mean_load_capacities(np.zeros((1, 4)), 0.01).tolist() == [0.0]


def test_pack_max_load_respects_slots_per_rank():
    assert pack_max_loads(np.array([[5.0, 5, 1, 1]]), 2, 2).tolist() == [6.0]
    assert pack_max_loads(np.array([[9.0, 1, 1, 1]]), 2, 2).tolist() == [10.0]


# --- properties ---------------------------------------------------------------------------------

def permute_ranks(w: tm.Window, perm: np.ndarray) -> tm.Window:
    """The same window with rank i's data moved to rank position where perm says (slots move in blocks)."""
    spr = w.slots_per_rank
    slot_perm = np.concatenate([np.arange(r * spr, (r + 1) * spr) for r in perm])
    by_rank = {name: getattr(w, name)[:, perm] for name in
               ("local_tokens", "sent_tokens", "received_tokens", "dispatch_seconds", "combine_seconds",
                "compute_seconds", "layer_seconds")}
    return w.replace(physical_to_logical_map=w.physical_to_logical_map[:, slot_perm],
                     slot_tokens=w.slot_tokens[:, slot_perm], traffic=w.traffic[:, perm][:, :, perm], **by_rank)


def outcome(w: tm.Window) -> list[tuple]:
    return [(d.verdict, d.cause, d.overflow) for d in diagnose(w).layers]


SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(name=st.sampled_from(list(SCENARIOS)), seed=st.integers(0, 2**16), perm=st.permutations(range(4)))
def test_permuting_ranks_with_their_data_keeps_verdicts(name, seed, perm):
    w = simulate(SCENARIOS[name], seed=seed)
    permuted = permute_ranks(w, np.array(perm))
    assert outcome(permuted) == outcome(w)
    np.testing.assert_allclose(tm.balancedness(permuted), tm.balancedness(w))


@SETTINGS
@given(name=st.sampled_from(list(SCENARIOS)), seed=st.integers(0, 2**16),
       factor=st.floats(1e-3, 1e3, allow_nan=False, allow_infinity=False))
def test_scaling_every_time_keeps_verdicts(name, seed, factor):
    w = simulate(SCENARIOS[name], seed=seed)
    scaled = w.replace(**{n: getattr(w, n) * factor for n in
                          ("dispatch_seconds", "combine_seconds", "compute_seconds", "layer_seconds", "step_seconds")})
    assert outcome(scaled) == outcome(w)


traffic_matrices = st.integers(2, 6).flatmap(
    lambda w: st.lists(st.lists(st.integers(0, 10_000), min_size=w, max_size=w), min_size=w, max_size=w))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(traffic=traffic_matrices)
def test_balancedness_is_in_zero_one(hand, traffic):
    n = len(traffic)
    w = hand.window(traffic, [0.1] * n, [0.1] * n, [0.1] * n)
    b = tm.balancedness(w)[0]
    assert 0.0 < b <= 1.0
    load = np.asarray(traffic).sum(axis=0)
    if load.max() > 0:
        assert b == pytest.approx(load.mean() / load.max())
