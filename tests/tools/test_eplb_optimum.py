"""The EPLB benchmark's reference (tools/eplb_optimum.py): the integer program's optimum is the fewest
slots any placement with the given counts at the target rewrites (checked by enumerating every
placement of tiny layers), its LP bound is at most that, and any feasible placement (the mending's)
rewrites at least that."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from moewatch.planner.incremental import repair_placement
from moewatch.planner.placement_math import contiguous_placement, replica_counts_of
from moewatch.tools.eplb_optimum import busiest_gpu_load, fewest_slots_rewritten, slack_bound


def _every_placement(num_experts: int, num_slots: int) -> np.ndarray:
    """[n, P] every placement of P slots over E experts in which each expert holds a slot."""
    rows = np.array(list(itertools.product(range(num_experts), repeat=num_slots)), dtype=np.int64)
    return rows[np.all([(rows == e).any(axis=1) for e in range(num_experts)], axis=0)]


def _brute_force(load, current, counts, num_gpus, target, most_per_gpu):
    """The fewest slots rewritten over every placement with `counts`, at most `most_per_gpu` of an
    expert on one GPU and the busiest GPU at most `target` (None: none is)."""
    E, P = load.shape[0], current.shape[0]
    best = None
    for row in _every_placement(E, P):
        if (np.bincount(row, minlength=E) != counts).any():
            continue
        per_gpu = np.array([np.bincount(g, minlength=E) for g in row.reshape(num_gpus, -1)])
        if (per_gpu > most_per_gpu).any() or busiest_gpu_load(load, row, num_gpus) > target * (1 + 1e-9):
            continue
        moved = int((row != current).sum())
        best = moved if best is None else min(best, moved)
    return best


@pytest.mark.parametrize("num_experts,num_slots,num_gpus,most", [(3, 6, 2, 1), (4, 8, 2, 1), (4, 8, 4, 1),
                                                                 (3, 6, 2, 2), (5, 8, 4, 1)])
def test_integer_optimum_is_the_brute_force_one_and_the_lp_bound_is_below_it(num_experts, num_slots, num_gpus,
                                                                              most):
    rng = np.random.default_rng(num_experts * 100 + num_slots + num_gpus + most)
    placements = _every_placement(num_experts, num_slots)
    per_gpu = np.stack([np.stack([np.bincount(g, minlength=num_experts) for g in row.reshape(num_gpus, -1)])
                        for row in placements])
    allowed = placements[(per_gpu <= most).all(axis=(1, 2))]
    checked = 0
    for _ in range(12):
        load = rng.integers(1, 50, num_experts).astype(np.float64)
        current = placements[rng.integers(len(placements))]
        # counts and target from a placement that exists, so the target is reachable with them
        other = allowed[rng.integers(len(allowed))]
        counts = np.bincount(other, minlength=num_experts)
        target = busiest_gpu_load(load, other, num_gpus) * rng.uniform(1.0, 1.3)
        most_per_gpu = np.full(num_experts, most)
        brute = _brute_force(load, current, counts, num_gpus, target, most_per_gpu)
        exact = fewest_slots_rewritten(load, current, counts, num_gpus, target, integer=True, time_limit=60,
                                       max_per_gpu=most_per_gpu)
        relaxed = fewest_slots_rewritten(load, current, counts, num_gpus, target, integer=False,
                                         max_per_gpu=most_per_gpu)
        assert exact.optimal and exact.slots_rewritten == brute == exact.slots_rewritten_bound
        assert relaxed.slots_rewritten_bound <= brute
        assert slack_bound(load, current, counts, num_gpus, target) <= brute
        row = exact.map_row
        assert int((row != current).sum()) == brute
        assert (np.bincount(row, minlength=num_experts) == counts).all()
        assert busiest_gpu_load(load, row, num_gpus) <= target * (1 + 1e-9)
        checked += brute > 0
    assert checked >= 4  # most draws need moves: the optimum is not trivially zero


def test_the_mendings_placement_rewrites_at_least_the_optimum_and_the_lp_bound_is_below_it():
    rng = np.random.default_rng(7)
    L, E, P, W = 3, 16, 24, 8
    load = rng.lognormal(0.0, 1.0, (L, E)) * 1000
    current = contiguous_placement(L, E, P)
    mended = repair_placement(load, current, W, 0.01, num_nodes=2)
    counts = replica_counts_of(mended.physical_to_logical_map, E)
    for layer in range(L):
        row = mended.physical_to_logical_map[layer]
        target = max(float(mended.target_max[layer]), busiest_gpu_load(load[layer], row, W))
        moved = int((row != current[layer]).sum())
        exact = fewest_slots_rewritten(load[layer], current[layer], counts[layer], W, target, integer=True,
                                       time_limit=60)
        relaxed = fewest_slots_rewritten(load[layer], current[layer], counts[layer], W, target, integer=False)
        assert exact.optimal
        assert relaxed.slots_rewritten_bound <= exact.slots_rewritten <= moved
        assert slack_bound(load[layer], current[layer], counts[layer], W, target) <= exact.slots_rewritten
        assert moved > 0


def test_the_slack_bound_is_above_the_lp_bound_where_whole_replicas_cannot_fill_the_room():
    # The benchmark's shape, one layer of each kind of load from the contiguous start, at the
    # mending's target: the LP fills GPUs to the limit with fractions of replicas; the slack bound
    # counts the room whole replicas leave, and no placement (the mending's included) beats it.
    from moewatch.tools.synthetic import popularity, sample_load

    rng = np.random.default_rng(3)
    E, P, W = 256, 320, 64
    for kind in ("lognormal", "zipf", "hot"):
        load = sample_load(popularity(kind, 1, E, rng), 64 * 256 * 8 * 1000, rng).astype(np.float64)
        current = contiguous_placement(1, E, P)
        mended = repair_placement(load, current, W, 0.005, num_nodes=8)
        assert mended.reached.all()
        row, target = mended.physical_to_logical_map[0], float(mended.target_max[0])
        counts = replica_counts_of(mended.physical_to_logical_map, E)[0]
        lp = fewest_slots_rewritten(load[0], current[0], counts, W, target, integer=False).slots_rewritten_bound
        bound = slack_bound(load[0], current[0], counts, W, target)
        assert lp * 1.2 < bound <= int((row != current[0]).sum())


def test_the_slack_bound_refuses_counts_that_do_not_fill_the_slots_and_is_zero_where_nothing_must_move():
    load = np.array([4.0, 3.0, 2.0, 1.0])
    assert slack_bound(load, np.array([0, 3, 1, 2]), np.ones(4, dtype=np.int64), 2, 5.0) == 0
    assert slack_bound(load, np.array([0, 1, 2, 3]), np.ones(4, dtype=np.int64), 2, 5.0) == 2
    assert slack_bound(load, np.array([0, 1, 2, 3]), np.ones(4, dtype=np.int64), 2, 4.9) == 5  # no room: P + 1
    with pytest.raises(ValueError, match="sum to the 4 slots"):
        slack_bound(load, np.array([0, 1, 2, 3]), np.array([1, 1, 1, 2]), 2, 5.0)


def test_a_current_map_at_the_target_needs_nothing_and_counts_that_do_not_fill_the_slots_are_refused():
    load = np.array([4.0, 3.0, 2.0, 1.0])
    current = np.array([0, 3, 1, 2])
    found = fewest_slots_rewritten(load, current, np.ones(4, dtype=np.int64), 2, 5.0, integer=True)
    assert (found.slots_rewritten_bound, found.slots_rewritten, found.status) == (0, 0, "current map meets the target")
    tighter = fewest_slots_rewritten(load, np.array([0, 1, 2, 3]), np.ones(4, dtype=np.int64), 2, 5.0, integer=True)
    assert tighter.slots_rewritten == 2 and tighter.optimal  # {0, 3} | {1, 2}: one exchange, two slots
    with pytest.raises(ValueError, match="sum to the 4 slots"):
        fewest_slots_rewritten(load, current, np.array([1, 1, 1, 2]), 2, 5.0, integer=False)
    impossible = fewest_slots_rewritten(load, current, np.ones(4, dtype=np.int64), 2, 4.5, integer=True)
    assert impossible.status == "infeasible" and impossible.slots_rewritten is None
