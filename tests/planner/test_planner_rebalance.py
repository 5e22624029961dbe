"""gated_rebalance, the decision behind the engines' EPLB policies: minimal movement, a per-layer gate
priced in seconds, idle and fresh cases, settings from the environment."""

from __future__ import annotations

import numpy as np
import pytest

from moewatch.planner import rebalance as rb
from moewatch.checks import is_valid_placement
from moewatch.planner.placement_math import contiguous_placement, placement_balancedness

L, E, P, W, N = 6, 32, 40, 8, 2


def skewed(seed: int = 0, scale: float = 1e6) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.lognormal(0.0, 1.2, (L, E)) * scale


CHEAP = rb.RebalanceSettings(expert_bytes=1.0)  # moving costs nothing: every better layer moves


def test_a_cheap_move_takes_every_improving_layer_and_a_stable_load_then_stays():
    load = skewed()
    current = contiguous_placement(L, E, P)
    first = rb.gated_rebalance(load, P, W, N, current=current, settings=CHEAP)
    assert first.reasons == (rb.MOVED,) * L
    assert (first.balancedness_after > first.balancedness_before).all()
    assert is_valid_placement(first.physical_to_logical_map, E, W)
    np.testing.assert_allclose(first.balancedness_after, placement_balancedness(load, first.physical_to_logical_map, W))
    again = rb.gated_rebalance(load, P, W, N, current=first.physical_to_logical_map, settings=CHEAP)
    assert again.experts_moved.sum() == 0
    np.testing.assert_array_equal(again.physical_to_logical_map, first.physical_to_logical_map)


def test_the_gate_keeps_a_layer_whose_gain_does_not_pay_for_its_stall():
    load = skewed()
    current = contiguous_placement(L, E, P)
    cheap = rb.gated_rebalance(load, P, W, N, current=current, settings=CHEAP)
    # Price each move at 10x the largest predicted gain: nothing pays.
    costly = rb.RebalanceSettings(expert_bytes=1.0, gain_margin=10 * cheap.predicted_gain_seconds.max() /
                                  cheap.predicted_stall_seconds[cheap.predicted_stall_seconds > 0].min())
    kept = rb.gated_rebalance(load, P, W, N, current=current, settings=costly)
    assert kept.reasons == (rb.KEPT_NOT_PAYING,) * L
    np.testing.assert_array_equal(kept.physical_to_logical_map, current)
    assert kept.experts_moved.sum() == 0 and kept.record()["layers_moved"] == 0
    # A longer horizon makes the same move pay.
    longer = rb.RebalanceSettings(expert_bytes=1.0, gain_margin=costly.gain_margin, horizon_steps=3000.0 * 100)
    assert rb.gated_rebalance(load, P, W, N, current=current, settings=longer).reasons == (rb.MOVED,) * L


def test_gain_and_stall_are_priced_from_the_busiest_gpu_and_the_bytes_moved():
    load = skewed()
    current = contiguous_placement(L, E, P)
    s = rb.RebalanceSettings(expert_bytes=5e8, link_bytes_per_second=1e10, inter_node_bytes_per_second=1e9,
                             window_steps=10, horizon_steps=1000)
    d = rb.gated_rebalance(load, P, W, 1, current=current, settings=s)
    proposed, _ = rb.propose(load, current, P, W, 1, s.tolerance)
    from moewatch.planner.placement_math import gpu_load
    drop = gpu_load(load, current, W).max(axis=1) - gpu_load(load, proposed, W).max(axis=1)
    np.testing.assert_allclose(d.predicted_gain_seconds, drop / 10 * s.seconds_per_pair * 1000)
    # one node: every changed slot loads over the fast link
    np.testing.assert_allclose(d.predicted_stall_seconds, (proposed != current).sum(axis=1) * 5e8 / 1e10)


def test_idle_layers_keep_their_row_and_all_zero_load_returns_the_current_map():
    load = skewed()
    load[2] = 0.0
    current = np.roll(contiguous_placement(L, E, P), 3, axis=1)
    d = rb.gated_rebalance(load, P, W, N, current=current, settings=CHEAP)
    assert d.reasons[2] == rb.KEPT_IDLE
    np.testing.assert_array_equal(d.physical_to_logical_map[2], current[2])
    zero = rb.gated_rebalance(np.zeros((L, E)), P, W, N, current=current)
    np.testing.assert_array_equal(zero.physical_to_logical_map, current)
    assert zero.reasons == (rb.KEPT_IDLE,) * L


def test_a_changed_slot_count_or_empty_slots_are_placed_afresh():
    load = skewed()
    old = contiguous_placement(L, E, P)
    for current, slots in ((old, 48), (np.where(np.arange(P) >= P - 2, -1, old), P)):
        d = rb.gated_rebalance(load, slots, W, N, current=current, settings=CHEAP)
        assert d.physical_to_logical_map.shape == (L, slots)
        assert d.reasons == (rb.FRESH,) * L
        assert is_valid_placement(d.physical_to_logical_map, E, W)
        assert d.physical_to_logical_map.dtype == np.int64


def test_same_inputs_give_the_same_bytes():
    load = skewed(3)
    current = contiguous_placement(L, E, P)
    maps = [rb.gated_rebalance(load.copy(), P, W, N, current=current.copy()).physical_to_logical_map
            for _ in range(2)]
    assert maps[0].tobytes() == maps[1].tobytes()


def test_settings_from_the_environment_are_validated_naming_the_variable():
    s = rb.RebalanceSettings.from_env({"MOEWATCH_EPLB_HORIZON_STEPS": "600", "MOEWATCH_EPLB_EXPERT_BYTES": "1e6",
                                       "UNRELATED": "x"})
    assert (s.horizon_steps, s.expert_bytes, s.window_steps) == (600.0, 1e6, 1000.0)
    for name, value in (("MOEWATCH_EPLB_GAIN_MARGIN", "lots"), ("MOEWATCH_EPLB_HORIZON_STEPS", "-1"),
                        ("MOEWATCH_EPLB_WINDOW_STEPS", "0"), ("MOEWATCH_EPLB_TOLERANCE", "1"),
                        ("MOEWATCH_EPLB_EXPERT_BYTES", "nan")):
        with pytest.raises(ValueError, match=name):
            rb.RebalanceSettings.from_env({name: value})


def test_bad_load_is_refused():
    with pytest.raises(ValueError, match="load"):
        rb.gated_rebalance(-skewed(), P, W, N)


def test_a_layer_whose_full_mending_does_not_pay_takes_a_shorter_one_that_does():
    from moewatch.planner.incremental import repair_placement

    load = skewed(5)
    current = contiguous_placement(L, E, P).astype(np.int64)
    base = rb.RebalanceSettings(expert_bytes=5e8)
    full, _ = rb.propose(load, current, P, W, N, base.tolerance)
    gain_f, stall_f = rb.layer_gain_and_stall(load, current, full, W, N, base)
    short = repair_placement(load, current, W, rb.SHORTER_TOLERANCES[-1], N).physical_to_logical_map
    gain_s, stall_s = rb.layer_gain_and_stall(load, current, short, W, N, base)
    ratio_f, ratio_s = gain_f / stall_f, gain_s / stall_s
    layer = int(np.argmax(ratio_s / ratio_f))
    assert ratio_s[layer] > ratio_f[layer]  # the shorter mending pays more per second of stall there
    margin = float(np.sqrt(ratio_s[layer] * ratio_f[layer]))  # between the two: only the shorter pays
    d = rb.gated_rebalance(load, P, W, N, current=current,
                           settings=rb.RebalanceSettings(expert_bytes=5e8, gain_margin=margin))
    assert d.reasons[layer] == rb.MOVED_LESS
    assert d.balancedness_before[layer] < d.balancedness_after[layer] < d.balancedness_proposed[layer]
    assert 0 < d.experts_moved[layer] < (full[layer] != current[layer]).sum()
    assert d.predicted_gain_seconds[layer] > margin * d.predicted_stall_seconds[layer]
    record = d.record()
    assert record["layer_outcomes"]["moved_less"] >= 1 and record["layers_moved"] >= 1
    np.testing.assert_allclose(d.balancedness_after, placement_balancedness(load, d.physical_to_logical_map, W))
