"""Nodes: cross-node pairs from the traffic matrix, the placement's prediction, migration over the
slower link (moewatch/topology.py), checked against hand counts."""

from __future__ import annotations

import numpy as np
import pytest

from moewatch import topology


def test_cross_node_ratio_counts_only_pairs_between_nodes():
    # 4 ranks, 2 per node: ranks 0, 1 on node 0; ranks 2, 3 on node 1.
    traffic = np.array([[[5, 1, 2, 0],
                         [1, 5, 0, 3],
                         [0, 0, 5, 1],
                         [4, 0, 1, 5]]])
    crossed = 2 + 3 + 0 + 0 + 4 + 0  # rows 0,1 into ranks 2,3 and rows 2,3 into ranks 0,1
    assert topology.cross_node_pairs(traffic, 2).tolist() == [crossed]
    ratio = topology.cross_node_ratio(traffic, 4, 2, 1)
    assert ratio.tolist() == pytest.approx([crossed / traffic.sum()])
    # One node: nothing crosses, whatever the traffic (and even without it).
    assert topology.cross_node_ratio(traffic, 4, 4, 1).tolist() == [0.0]
    assert topology.cross_node_ratio(None, 4, 4, 3).tolist() == [0.0, 0.0, 0.0]
    # Several nodes without the matrix: unknown, not guessed.
    assert topology.cross_node_ratio(None, 4, 2, 1) is None
    # An idle layer crosses nothing.
    assert topology.cross_node_ratio(np.zeros((1, 4, 4), np.int64), 4, 2, 1).tolist() == [0.0]


def test_num_nodes_and_node_of_rank():
    assert topology.num_nodes(8, 4) == 2 and topology.num_nodes(8, 8) == 1 and topology.num_nodes(6, 4) == 1
    assert topology.node_of_rank(4, 2).tolist() == [0, 0, 1, 1]
    assert topology.node_of_rank(2, 1).tolist() == [0, 1]


def test_expected_cross_node_ratio_falls_when_every_node_holds_the_expert():
    # 2 experts, 4 slots on 2 ranks = 2 nodes of 1 rank. Expert 0 carries all the load.
    load = np.array([[100, 0]])
    one_copy = np.array([[0, 1, 1, 1]])  # expert 0 only on node 0: half the tokens start on node 1
    both = np.array([[0, 1, 0, 1]])  # expert 0 on both nodes: no pair need leave its node
    assert topology.expected_cross_node_ratio(load, one_copy, 2, 1).tolist() == [0.5]
    assert topology.expected_cross_node_ratio(load, both, 2, 1).tolist() == [0.0]


def test_migration_is_priced_at_the_slower_link_across_nodes():
    # 4 slots on 4 ranks, 2 nodes: slots 0, 1 on node 0, slots 2, 3 on node 1.
    old = np.array([0, 1, 2, 3])
    same_node = np.array([0, 0, 2, 3])  # slot 1 takes expert 0, held on node 0: the fast link
    other_node = np.array([0, 1, 2, 0])  # slot 3 takes expert 0, held only on node 0: the slow link
    kwargs = dict(world_size=4, ranks_per_node=2, expert_bytes=1e9, intra_bytes_per_second=1e11,
                  inter_bytes_per_second=1e10)
    assert topology.migration_seconds(old, same_node, **kwargs) == pytest.approx(0.01)
    assert topology.migration_seconds(old, other_node, **kwargs) == pytest.approx(0.1)
    assert topology.migration_seconds(old, old, **kwargs) == 0.0
    # On one node every move takes the fast link.
    assert topology.migration_seconds(old, other_node, **{**kwargs, "ranks_per_node": 4}) == pytest.approx(0.01)


def test_evidence_names_the_inter_node_link_only_for_groups_that_span_nodes():
    assert topology.cross_node_evidence(0.4, 0.2, 8, 8, True, 0.1) is None
    line = topology.cross_node_evidence(0.4, 0.2, 8, 4, True, 0.1)
    assert "40% of pairs cross nodes" in line and "2 nodes of 4 ranks" in line and "node-aware" in line
    assert "unknown" in topology.cross_node_evidence(None, 0.2, 8, 4, False, 0.1)


def test_migration_seconds_matches_a_slot_by_slot_recount():
    rng = np.random.default_rng(3)
    for _ in range(50):
        W, G, E = 8, int(rng.choice([1, 2, 4, 8])), 12
        P = 16
        old = np.concatenate([np.arange(E), rng.integers(0, E, P - E)])
        new = np.concatenate([rng.permutation(E), rng.integers(0, E, P - E)])
        expected = 0.0
        for slot in range(P):  # the documented rule, one slot at a time
            if old[slot] == new[slot]:
                continue
            node = slot // (P // W) // G
            sources = [s // (P // W) // G for s in range(P) if old[s] == new[slot]]
            expected += 1.0 / (10.0 if node in sources else 1.0)
        got = topology.migration_seconds(old, new, W, G, expert_bytes=1.0, intra_bytes_per_second=10.0,
                                         inter_bytes_per_second=1.0)
        assert got == pytest.approx(expected)
