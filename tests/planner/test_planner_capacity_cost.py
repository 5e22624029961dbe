"""Capacity factor from per-step loads; the cost model's traffic, stall and least-squares fit."""

from __future__ import annotations

import numpy as np
import pytest

from moewatch import capacity
from moewatch.planner import cost, placement_math, solve_placement


def test_step_overflow_rate_by_hand():
    # one step, one layer, experts [6, 2, 2, 2]: mean 3; at C = 1 capacity 3 -> 3 of 12 pairs overflow
    steps = np.array([[[6.0, 2.0, 2.0, 2.0]]])
    assert capacity.step_overflow_rate(steps, np.array([1.0])) == pytest.approx([0.25])
    assert capacity.step_overflow_rate(steps, np.array([2.0])) == pytest.approx([0.0])


def test_capacity_is_the_smallest_factor_meeting_the_target(rng):
    steps = rng.poisson(rng.lognormal(3, 0.7, size=(1, 3, 32)), size=(40, 3, 32)).astype(float)
    result = capacity.capacity_for_target(steps, top_k=4, target=0.01, hidden_bytes=100)
    c = result.capacity_factor
    assert (capacity.step_overflow_rate(steps, c) <= 0.01).all()
    assert (capacity.step_overflow_rate(steps, c - 0.002) > 0.01).all()  # rounded up to 1e-3 only
    assert np.allclose(result.buffer_pairs, c * steps.sum(axis=2).max(axis=0))
    assert np.allclose(result.buffer_bytes, 100 * result.buffer_pairs)
    assert np.allclose(result.tokens_per_step, steps[:, 0].sum(axis=1) / 4)
    looser = capacity.capacity_for_target(steps, target=0.05).capacity_factor
    assert (looser <= c).all()


def test_even_loads_need_a_factor_of_one():
    steps = np.full((5, 2, 8), 10.0)
    assert capacity.capacity_for_target(steps, target=0.0).capacity_factor == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize("bad, field", [(np.ones((2, 3)), "step_loads"), (-np.ones((1, 1, 2)), "step_loads")])
def test_capacity_rejects_bad_input(bad, field):
    with pytest.raises(ValueError, match=field):
        capacity.capacity_for_target(bad)


def test_expected_traffic_follows_the_replica_choice(rng):
    load = rng.lognormal(0, 1, size=(3, 16)) * 100
    pmap = solve_placement(load, 8, 24, 2).physical_to_logical_map
    traffic = cost.expected_traffic(load, pmap, 8, 2)
    assert np.allclose(traffic.sum(axis=(1, 2)), load.sum(axis=1))
    local = np.trace(traffic, axis1=1, axis2=2) / load.sum(axis=1)
    cross_gpu, cross_node = placement_math.dispatch_cross_shares(load, pmap, 8, 2)
    assert np.allclose(1 - local, cross_gpu)
    per = cost.rank_traffic(traffic, 2)
    assert np.allclose(per["send_inter"].sum(axis=1) / load.sum(axis=1), cross_node)


def test_migration_stall_per_step():
    model = cost.CostModel(migration_bytes_per_second=100.0)
    out = cost.migration_stall(model, np.array([2, 0, 1, 3]), expert_bytes=50.0, layers_per_step=2)
    assert out["bytes_moved"] == 300.0 and out["stall_seconds"] == 3.0
    # per-layer stalls 1, 0.5, 1.5 s: two steps of two changed layers, then one
    assert out["steps"] == 2 and out["max_step_stall_seconds"] == 1.5


def test_fit_recovers_the_parameters_that_made_the_windows(rng, window_from_traffic):
    truth = cost.CostModel(seconds_per_pair=3e-7, seconds_per_local_expert=4e-6, fixed_seconds=1e-5,
                           seconds_per_byte_intra=1 / 300e9, seconds_per_byte_inter=1 / 20e9,
                           seconds_per_message=7e-6)
    windows = []
    G, steps, hidden = 4, 10, 4096
    for world in (8, 8, 4, 4):  # two group sizes: the per-message cost and the bandwidths separate
        traffic = rng.integers(0, 3000, size=(5, world, world))
        per = cost.rank_traffic(traffic.astype(float), max(world // G, 1))
        pairs = traffic.sum(axis=1)
        compute = steps * (truth.seconds_per_pair * pairs / steps + truth.seconds_per_local_expert + truth.fixed_seconds)
        send = per["send_intra"] * truth.seconds_per_byte_intra + per["send_inter"] * truth.seconds_per_byte_inter
        recv = per["recv_intra"] * truth.seconds_per_byte_intra + per["recv_inter"] * truth.seconds_per_byte_inter
        # Aurora's bound: the slowest rank and direction, dispatch and combine alike
        one_way = np.maximum(send, recv).max(axis=1) * hidden / steps + truth.seconds_per_message * (world - 1)
        a2a = np.repeat((2 * steps * one_way)[:, None], world, axis=1)  # dispatch + combine
        windows.append(window_from_traffic(traffic, compute, a2a / 2, a2a / 2, ranks_per_node=min(G, world),
                                           hidden_bytes=hidden, steps=steps))
    model, report = cost.fit(windows, base=cost.CostModel(seconds_per_local_expert=4e-6))
    assert report.r2_compute > 0.999999 and report.r2_a2a > 0.999999
    assert report.samples_a2a == 20 and report.samples_compute == 5 * (8 + 8 + 4 + 4)
    for name in ("seconds_per_pair", "fixed_seconds", "seconds_per_byte_intra", "seconds_per_byte_inter",
                 "seconds_per_message"):
        assert name in report.fitted
        assert getattr(model, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    # the per-expert cost never varied (one expert per rank): it keeps its base value
    assert "seconds_per_local_expert" not in report.fitted


def test_sweep_shows_a_u_shape_against_expert_count():
    model = cost.CostModel()
    rows = cost.sweep(model, [2, 4, 8, 16, 32, 64, 128, 256, 512], None, [1024], top_k=2, hidden_bytes=14336)
    totals = [r["total"] for r in rows]
    best = int(np.argmin(totals))
    assert 0 < best < len(totals) - 1  # falls, then rises
    assert all(r["ranks"] == r["experts"] for r in rows)
    assert cost.sweep(model, [4], None, [8], top_k=8, hidden_bytes=1) == []  # fewer experts than top-k


def test_cost_model_from_dict_rejects_bad_parameters():
    assert cost.CostModel.from_dict({"seconds_per_pair": 1e-7}).seconds_per_pair == 1e-7
    with pytest.raises(ValueError, match="unknown"):
        cost.CostModel.from_dict({"speed": 1})
    with pytest.raises(ValueError, match="seconds_per_pair"):
        cost.CostModel.from_dict({"seconds_per_pair": -1})


def test_layer_seconds_prefers_the_balanced_plan(rng):
    load = rng.lognormal(0, 1.5, size=(2, 32)) * 200
    balanced = solve_placement(load, 8, 40).physical_to_logical_map
    contiguous = placement_math.contiguous_placement(2, 32, 40)
    gain = cost.plan_gain_seconds(cost.CostModel(), load, contiguous, balanced, 8, 14336)
    assert gain > 0
