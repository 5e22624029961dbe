"""Ranks of different speeds: the planner balances each rank's time (load / speed), equal speeds
change nothing, and on small cases the search reaches the best placement an exhaustive search finds."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from click.testing import CliRunner

from moewatch.cli import main
from moewatch.planner import PlacementShapeError, solve_placement
from moewatch.planner.affinity import transitions_from_trace
from moewatch.planner.placement_math import (gpu_load, normalised_rank_speed, placement_time_balancedness,
                                             repeats_only_as_padding)
from moewatch.tools.synthetic import affinity_trace, synthetic_load


def _max_time(load_row, row, speed):
    speed = np.asarray(speed, dtype=np.float64)
    return float((gpu_load(np.asarray(load_row, float)[None], np.asarray(row)[None], speed.size)[0] / speed).max())


def _brute_force_best(load_row, num_slots, speed):
    """The lowest busiest time over every placement that holds each expert and repeats an expert on
    a GPU only when no other GPU holds it; written apart from the planner's helpers."""
    load_row = np.asarray(load_row, dtype=np.float64)
    speed = np.asarray(speed, dtype=np.float64)
    E, W = load_row.size, speed.size
    S = num_slots // W
    rows = np.array(list(itertools.product(range(E), repeat=num_slots)))  # [N, P]
    gpu = np.arange(num_slots) // S
    copies = np.stack([np.stack([((rows == e) & (gpu == g)).sum(axis=1) for g in range(W)], axis=1)
                       for e in range(E)], axis=1)  # [N, E, W]
    count = copies.sum(axis=2)
    valid = (count >= 1).all(axis=1)
    valid &= ~((copies.max(axis=2) > 1) & ((copies > 0).sum(axis=2) > 1)).any(axis=1)
    per_copy = load_row[None, :] / np.maximum(count, 1)
    times = (copies * per_copy[:, :, None]).sum(axis=1) / speed[None, :]
    return float(times.max(axis=1)[valid].min())


def _equal_speed_cases():
    load = synthetic_load("lognormal", 3, 16, pairs_per_layer=3000, seed=3)
    wide = synthetic_load("zipf", 3, 32, pairs_per_layer=5000, seed=4)
    current = solve_placement(synthetic_load("zipf", 3, 32, pairs_per_layer=5000, seed=9), 8, 40, 2)
    trace = affinity_trace(300, 3, 16, 2, 4, seed=0)
    return [
        dict(load=load, num_gpus=4),
        dict(load=load, num_gpus=4, num_slots=24),
        dict(load=load, num_gpus=6, num_slots=18),  # W does not divide E
        dict(load=wide, num_gpus=8, num_slots=40, num_nodes=2),
        dict(load=wide, num_gpus=8, num_slots=40, num_nodes=2, current=current.physical_to_logical_map),
        dict(load=load, num_gpus=4, num_slots=20, affinity=transitions_from_trace(trace, 16)),
        dict(load=wide, num_gpus=8, num_slots=48, max_replicas=1),
        dict(load=wide, num_gpus=8, num_slots=40, num_nodes=2, max_replicas=1,
             current=current.physical_to_logical_map),
    ]


@pytest.mark.parametrize("case", range(len(_equal_speed_cases())))
def test_equal_speeds_give_the_speed_oblivious_plan_bit_for_bit(case):
    kwargs = _equal_speed_cases()[case]
    base = solve_placement(**kwargs)
    W = kwargs["num_gpus"]
    for speeds in (None, [1.0] * W, [2.5] * W, [7] * W):
        ours = solve_placement(**kwargs, rank_speed=speeds)
        for field in ("physical_to_logical_map", "balancedness_before", "balancedness_after", "experts_moved",
                      "cross_gpu_share_after", "cross_node_share_after"):
            assert np.array_equal(getattr(ours, field), getattr(base, field)), (speeds, field)
        assert ours.method == base.method and ours.layer_methods == base.layer_methods
        assert np.array_equal(ours.time_balancedness_after, base.balancedness_after)
        assert np.array_equal(ours.time_balancedness_before, base.balancedness_before)
        assert (ours.rank_speed is None) == (speeds is None)
        if speeds is not None:
            assert np.array_equal(ours.rank_speed, np.ones(W))
        summary = ours.summary()
        assert summary["time_balancedness_after"] == summary["balancedness_after"]


def _small_cases():
    loads = {
        3: [[1, 1, 1], [5, 2, 1], [9, 3, 2]],
        4: [[1, 1, 1, 1], [6, 1, 1, 1], [4, 3, 2, 1], [10, 7, 2, 1]],
        5: [[1, 1, 1, 1, 1], [8, 4, 2, 1, 1], [5, 5, 3, 2, 1]],
    }
    speeds = {2: [[1, 0.5], [1, 2], [3, 1], [1, 0.9]], 3: [[1, 1, 0.5], [2, 1, 1], [1, 0.7, 0.4]]}
    for E, rows in loads.items():
        for W, speed_list in speeds.items():
            for P in range(E, 7):
                if P % W:
                    continue
                for load_row in rows:
                    for speed in speed_list:
                        yield E, P, W, load_row, speed


@pytest.mark.parametrize("E,P,W,load_row,speed", list(_small_cases()))
def test_small_cases_reach_the_exhaustive_optimum(E, P, W, load_row, speed):
    result = solve_placement([load_row], W, P, rank_speed=speed)
    row = result.physical_to_logical_map[0]
    best = _brute_force_best(load_row, P, speed)
    assert _max_time(load_row, row, speed) == pytest.approx(best, rel=1e-9)
    assert repeats_only_as_padding(result.physical_to_logical_map, E, W).all()
    assert np.bincount(row, minlength=E).min() >= 1


def test_a_slow_rank_holds_fewer_experts_and_pads_with_its_own():
    # 8 uniform experts in 12 slots on 2 ranks, rank 1 at half speed: every placement with
    # distinct experts per GPU gives 4 and 4 units (times 4 and 8); padding reaches 5.5 and 2.5.
    load = [[10.0] * 8]
    result = solve_placement(load, 2, 12, rank_speed=[1.0, 0.5])
    row = result.physical_to_logical_map[0]
    assert _max_time(load[0], row, [1.0, 0.5]) == pytest.approx(55.0)
    slow = row[6:]
    assert len(set(slow.tolist())) < 6  # the slow rank repeats some of its experts
    for expert in set(slow.tolist()):
        if (slow == expert).sum() > 1:
            assert expert not in row[:6]  # ... only ones no other GPU holds
    assert result.time_balancedness_before[0] == pytest.approx(0.75)
    assert result.time_balancedness_after[0] == pytest.approx(5.25 / 5.5)
    assert result.summary()["time_balancedness_after"] == pytest.approx(5.25 / 5.5)


def test_the_hot_expert_replicas_go_to_the_fast_ranks():
    # One hot expert and three light ones on three ranks, two of them fast: the best plan splits
    # the hot expert over the fast ranks and gives the slow rank light experts only.
    load = [[12.0, 1.0, 1.0, 1.0]]
    speed = [2.0, 2.0, 0.5]
    result = solve_placement(load, 3, 6, rank_speed=speed)
    row = result.physical_to_logical_map[0]
    assert _max_time(load[0], row, speed) == pytest.approx(_brute_force_best(load[0], 6, speed))
    hot_gpus = {int(s) // 2 for s in np.flatnonzero(row == 0)}
    assert hot_gpus == {0, 1}
    # the speed-oblivious plan spreads the hot expert over a slow rank too, or leaves it slower
    oblivious = solve_placement(load, 3, 6).physical_to_logical_map[0]
    assert _max_time(load[0], oblivious, speed) > _max_time(load[0], row, speed)


@pytest.mark.parametrize("seed", range(4))
def test_bigger_layers_repeat_only_as_padding_and_beat_the_oblivious_plan(seed):
    rng = np.random.default_rng(seed)
    load = synthetic_load("lognormal", 4, 24, pairs_per_layer=6000, seed=seed)
    speed = rng.uniform(0.4, 1.6, size=6)
    ours = solve_placement(load, 6, 36, rank_speed=speed)
    oblivious = solve_placement(load, 6, 36)
    pmap = ours.physical_to_logical_map
    assert repeats_only_as_padding(pmap, 24, 6).all()
    assert all(set(r.tolist()) == set(range(24)) for r in pmap)
    norm = speed / speed.mean()
    ours_max = (gpu_load(load, pmap, 6) / norm).max(axis=1)
    oblivious_max = (gpu_load(load, oblivious.physical_to_logical_map, 6) / norm).max(axis=1)
    assert (ours_max <= oblivious_max * (1 + 1e-12)).all() and (ours_max < oblivious_max).any()
    assert np.allclose(ours.time_balancedness_after, placement_time_balancedness(load, pmap, norm))
    assert np.allclose(ours.rank_speed, norm) and ours.rank_speed.mean() == pytest.approx(1.0)


def test_max_replicas_holds_with_speeds():
    load = synthetic_load("zipf", 3, 16, pairs_per_layer=4000, seed=2)
    result = solve_placement(load, 4, 32, rank_speed=[1, 1, 0.5, 2], max_replicas=2)
    counts = np.stack([np.bincount(r, minlength=16) for r in result.physical_to_logical_map])
    assert counts.max() <= 2 and counts.min() >= 1


def test_movement_with_speeds_stays_within_tolerance_and_moves_less_than_the_plan():
    load = synthetic_load("lognormal", 6, 32, pairs_per_layer=8000, seed=5)
    speed = [1.0, 1.0, 1.0, 1.0, 0.6, 1.4, 1.0, 1.0]
    in_force = solve_placement(load, 8, 40).physical_to_logical_map
    fresh = solve_placement(load, 8, 40, rank_speed=speed)
    moved = solve_placement(load, 8, 40, current=in_force, rank_speed=speed, tolerance=0.02)
    assert moved.method == "movement" and len(moved.layer_methods) == 6
    norm = np.asarray(speed) / np.mean(speed)
    best = (gpu_load(load, fresh.physical_to_logical_map, 8) / norm).max(axis=1)
    ours = (gpu_load(load, moved.physical_to_logical_map, 8) / norm).max(axis=1)
    assert (ours <= best / (1 - 0.02) * (1 + 1e-12)).all()
    assert moved.experts_moved.sum() <= (fresh.physical_to_logical_map != in_force).sum()
    again = solve_placement(load, 8, 40, current=moved.physical_to_logical_map, rank_speed=speed, tolerance=0.02)
    assert again.experts_moved.sum() == 0 and set(again.layer_methods) == {"kept"}


@pytest.mark.parametrize("speeds,words", [
    ([1.0, 1.0, 1.0], "expected 4 speeds"),
    ([[1.0, 1.0], [1.0, 1.0]], "expected 4 speeds"),
    ([1.0, 0.0, 1.0, 1.0], "> 0"),
    ([1.0, -2.0, 1.0, 1.0], "> 0"),
    ([1.0, float("nan"), 1.0, 1.0], "finite"),
    ([1.0, float("inf"), 1.0, 1.0], "finite"),
    (["fast", 1, 1, 1], "numbers"),
])
def test_bad_speeds_are_rejected_naming_rank_speed(speeds, words):
    with pytest.raises(PlacementShapeError) as info:
        solve_placement([[1.0] * 8], 4, rank_speed=speeds)
    assert info.value.field == "rank_speed" and str(info.value).startswith("rank_speed:")
    assert words in str(info.value)


def test_unequal_speeds_with_affinity_are_refused():
    trace = affinity_trace(100, 2, 8, 2, 2, seed=0)
    with pytest.raises(PlacementShapeError, match="rank_speed"):
        solve_placement(np.ones((2, 8)), 2, affinity=transitions_from_trace(trace, 8), rank_speed=[1, 2])


def test_repeats_count_only_as_padding():
    # [L, P] placements on 2 GPUs of 2 slots: pads of an expert alone on its GPU are fine, a second
    # local copy of an expert another GPU also holds is not
    pmap = np.array([[0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 0, 1], [0, 1, 1, 1]])
    assert repeats_only_as_padding(pmap, 2, 2).tolist() == [True, True, False, False]


def test_time_balancedness_is_mean_over_max_of_load_over_speed():
    # loads 6 and 2 at speeds 2 and 1 (normalised 4/3, 2/3): times 4.5 and 3
    load = np.array([[6.0, 2.0]])
    speed = normalised_rank_speed([2.0, 1.0], 2)
    assert placement_time_balancedness(load, np.array([[0, 1]]), speed)[0] == pytest.approx(3.75 / 4.5)


def test_normalised_rank_speed_keeps_ratios():
    assert np.array_equal(normalised_rank_speed([3, 3, 3], 3), np.ones(3))
    assert np.allclose(normalised_rank_speed([2, 1, 1], 3), [1.5, 0.75, 0.75])


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_plan_cli_takes_rank_speed_as_a_list_or_a_file(tmp_path):
    np.save(tmp_path / "load.npy", synthetic_load("lognormal", 3, 16, pairs_per_layer=3000, seed=1))
    base = ["plan", "--load", tmp_path / "load.npy", "--gpus", 4, "--slots", 20, "--out", tmp_path / "p.json"]
    listed = _cli(*base, "--rank-speed", "1,1,0.5,2", "--json")
    assert listed.exit_code == 0, listed.output
    summary = json.loads(listed.stdout)
    assert summary["time_balancedness_after"] > summary["time_balancedness_before"]
    assert summary["rank_speed"] == pytest.approx([1 / 1.125, 1 / 1.125, 0.5 / 1.125, 2 / 1.125])
    (tmp_path / "s.json").write_text(json.dumps([1, 1, 0.5, 2]))
    (tmp_path / "o.json").write_text(json.dumps({"rank_speed": [1, 1, 0.5, 2]}))
    for path in ("s.json", "o.json"):
        again = _cli(*base, "--rank-speed", tmp_path / path, "--json")
        assert again.exit_code == 0, again.output
        assert json.loads(again.stdout)["time_balancedness_after"] == summary["time_balancedness_after"]
    text = _cli(*base, "--rank-speed", "1,1,0.5,2")
    assert text.exit_code == 0 and "time balancedness" in text.stdout
    plain = _cli(*base, "--json")
    assert "time_balancedness_after" in json.loads(plain.stdout)


@pytest.mark.parametrize("value,words", [
    ("1,1,0.5", "expected 4 speeds"),
    ("1,a,1,1", "comma-separated"),
    ("1,0,1,1", "> 0"),
    ("bad.json", "not valid JSON"),
    ("nokey.json", "no \"rank_speed\" key"),
    ("strings.json", "list of numbers"),
])
def test_plan_cli_bad_rank_speed_names_the_flag(tmp_path, value, words):
    np.save(tmp_path / "load.npy", np.ones((2, 8)))
    (tmp_path / "bad.json").write_text("[1,")
    (tmp_path / "nokey.json").write_text("{\"speeds\": [1, 1, 1, 1]}")
    (tmp_path / "strings.json").write_text("[\"a\", 1, 1, 1]")
    arg = str(tmp_path / value) if value.endswith(".json") else value
    result = _cli("plan", "--load", tmp_path / "load.npy", "--gpus", 4, "--out", tmp_path / "p.json",
                  "--rank-speed", arg)
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--rank-speed" in lines[0] and words in lines[0], result.stderr
