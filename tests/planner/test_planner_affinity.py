"""Affinity placement: transition counts, the score's consistency, and a planted affinity found."""

from __future__ import annotations

import numpy as np

from moewatch.checks import is_valid_placement
from moewatch.planner import affinity, packing, placement_math, replicate, solve_placement
from moewatch.tools.synthetic import affinity_trace


def test_transitions_count_all_k_by_k_pairs_and_discount():
    trace = np.array([[[0, 1], [2, 3]], [[0, 2], [2, 1]]])  # 2 tokens, 2 layers, k = 2, E = 4
    t = affinity.transitions_from_trace(trace, 4)
    assert t.shape == (1, 4, 4)
    assert t[0, 0, 2] == 2 and t[0, 0, 3] == 1 and t[0, 1, 2] == 1 and t[0, 2, 1] == 1 and t[0, 0, 1] == 1
    assert t.sum() == 8
    assert affinity.transitions_from_trace(trace, 4, discount=1.0).sum() == 1.0
    assert affinity.load_from_trace(trace, 4).tolist() == [[2, 1, 1, 0], [0, 1, 2, 1]]


def test_scores_count_each_kept_pair_once_from_each_side(rng):
    L, E, W, P = 4, 16, 4, 20
    trace = rng.integers(0, E, size=(300, L, 2))
    t = affinity.transitions_from_trace(trace, E)
    load = affinity.load_from_trace(trace, E)
    pmap = packing.pack(load, replicate.replica_counts(load, P), W)
    layers = np.arange(L)
    score = affinity.layer_scores(t, pmap, layers, E, W)
    total = affinity.placement_score(score, pmap, W).sum()
    cross, _ = placement_math.transition_cross_shares(t, pmap, W)
    # with no expert twice on one GPU, in-scores and out-scores each add up to the kept pairs
    assert (placement_math.holders(pmap, E, W) <= 1).all()
    assert np.isclose(total, 2 * (1 - cross) * t.sum())


def test_round_robin_meets_every_pair_once():
    for W in (2, 5, 8):
        seen = set()
        for pairs in affinity.round_robin(W):
            flat = pairs.ravel().tolist()
            assert len(flat) == len(set(flat))
            seen.update(tuple(sorted(p)) for p in pairs.tolist())
        assert len(seen) == W * (W - 1) // 2


def test_planted_affinity_is_found_on_held_out_tokens_under_the_floor():
    L, E, W, P, topics = 6, 64, 8, 72, 8
    trace = affinity_trace(4000, L, E, 4, topics, stickiness=0.8, seed=3)
    fit, held = trace[:2000], trace[2000:]
    load = affinity.load_from_trace(fit, E)
    result = solve_placement(load, W, P, 2, affinity=affinity.transitions_from_trace(fit, E), balancedness_floor=0.95)
    pmap = result.physical_to_logical_map
    assert is_valid_placement(pmap, E, W)
    assert (result.balancedness_after >= 0.95 - 1e-12).all()
    held_t = affinity.transitions_from_trace(held, E)
    contiguous, _ = placement_math.transition_cross_shares(held_t, placement_math.contiguous_placement(L, E, P), W, 2)
    ours, _ = placement_math.transition_cross_shares(held_t, pmap, W, 2)
    assert ours < 0.75 * contiguous
    assert result.transition_cross_gpu_after < result.transition_cross_gpu_before


def test_no_affinity_signal_leaves_the_balanced_plan():
    load = np.ones((3, 8))
    result = solve_placement(load, 4, 8, affinity=np.zeros((2, 8, 8)))
    assert (result.balancedness_after == 1.0).all()
