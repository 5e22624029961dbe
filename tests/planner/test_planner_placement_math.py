"""Placement metrics on hand-checked examples."""

from __future__ import annotations

import numpy as np
import pytest

from moewatch.checks import is_valid_placement
from moewatch.planner import placement_math


def test_balancedness_splits_an_expert_evenly_over_its_replicas():
    # 2 GPUs x 2 slots; expert 0 (load 8) on both GPUs, experts 1 (2) and 2 (6) alone
    load = np.array([[8.0, 2.0, 6.0]])
    pmap = np.array([[0, 1, 0, 2]])
    assert placement_math.gpu_load(load, pmap, 2).tolist() == [[6.0, 10.0]]
    assert placement_math.placement_balancedness(load, pmap, 2) == pytest.approx([8.0 / 10.0])


def test_idle_layer_reads_balanced():
    assert placement_math.placement_balancedness(np.zeros((1, 2)), np.array([[0, 1]]), 2).tolist() == [1.0]


def test_dispatch_shares_follow_own_rank_then_own_node():
    # 4 GPUs in 2 nodes, one slot each: expert 0 on GPUs 0 and 2 (both nodes), expert 1 on GPU 1 only,
    # expert 2 on GPU 3 only.
    load = np.array([[10.0, 6.0, 4.0]])
    pmap = np.array([[0, 1, 0, 2]])
    cross_gpu, cross_node = placement_math.dispatch_cross_shares(load, pmap, 4, 2)
    # expert 0 leaves its rank for tokens on 2 of 4 ranks, never its node; experts 1 and 2 leave their
    # rank from 3 of 4 ranks and their node from 2 of 4
    assert cross_gpu[0] == pytest.approx((10 * 0.5 + 6 * 0.75 + 4 * 0.75) / 20)
    assert cross_node[0] == pytest.approx((10 * 0.0 + 6 * 0.5 + 4 * 0.5) / 20)


def test_transition_shares_count_pairs_that_stay_with_the_token():
    # 2 layers, 2 experts, 2 GPUs, one slot each. Layer 0: e0 on GPU 0, e1 on GPU 1.
    # Layer 1: e1 on GPU 0, e0 on GPU 1. Pairs: (0 -> 1) x 3 stays on GPU 0, (0 -> 0) x 1 crosses.
    transitions = np.zeros((1, 2, 2))
    transitions[0, 0, 1] = 3
    transitions[0, 0, 0] = 1
    pmap = np.array([[0, 1], [1, 0]])
    cross_gpu, cross_node = placement_math.transition_cross_shares(transitions, pmap, 2, 1)
    assert cross_gpu == pytest.approx(0.25)
    assert cross_node == 0.0


def test_transition_share_weights_a_replicated_source_by_its_replicas():
    # layer 0: e0 on both GPUs; layer 1: e1 on GPU 0 only. Half of e0's tokens sit on GPU 1 and cross.
    transitions = np.zeros((1, 2, 2))
    transitions[0, 0, 1] = 4
    pmap = np.array([[0, 1, 0, 1], [1, 0, 0, 0]])  # GPU 0: slots 0-1, GPU 1: slots 2-3
    cross_gpu, _ = placement_math.transition_cross_shares(transitions, pmap, 2, 1)
    assert cross_gpu == pytest.approx(0.5)


def test_contiguous_placement_and_moves():
    pmap = placement_math.contiguous_placement(2, 3, 6)
    assert pmap.tolist() == [[0, 1, 2, 0, 1, 2]] * 2
    other = pmap.copy()
    other[1, 4] = 2
    assert placement_math.experts_moved(pmap, other).tolist() == [0, 1]


def test_validity_and_sizes():
    assert is_valid_placement(np.array([[0, 1, 1, 0]]), 2, 2)
    assert not is_valid_placement(np.array([[0, 0, 0, 0]]), 2, 2)
    assert not is_valid_placement(np.array([[0, 1, 2]]), 3, 2)
    with pytest.raises(placement_math.PlacementShapeError, match="num_slots"):
        placement_math.check_sizes(4, 6, 4)
    with pytest.raises(placement_math.PlacementShapeError, match="num_nodes"):
        placement_math.check_sizes(4, 8, 4, 3)
    with pytest.raises(placement_math.PlacementShapeError, match="num_slots"):
        placement_math.check_sizes(5, 4, 2)
