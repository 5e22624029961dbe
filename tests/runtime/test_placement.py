"""Replica choice (own rank, then own node, then spread evenly) and migration planning."""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from moewatch.runtime.placement import (choose_slots, default_placement, plan_migration, replica_table,
                                         slot_ranks)

# W = 4 ranks in nodes of 2, two slots per rank. Expert 0 on ranks 0 and 3, expert 1 on ranks 2 and 3,
# expert 2 twice on rank 1, expert 3 only on rank 0.
PMAP = np.array([0, 3, 2, 2, 1, 4, 0, 1])


def _slots(rank, experts):
    table = replica_table(PMAP, world_size=4, ranks_per_node=2, num_experts=5)
    return choose_slots(torch.tensor(experts), rank, table).tolist()


def test_own_rank_first():
    assert _slots(0, [0, 0, 0]) == [0, 0, 0]
    assert _slots(3, [0, 1]) == [6, 7]


def test_own_node_before_remote_nodes():
    assert _slots(1, [0, 0]) == [0, 0]  # rank 0 shares rank 1's node; rank 3 does not
    assert _slots(2, [0, 0]) == [6, 6]  # rank 3 is rank 2's node mate


def test_spread_evenly_over_equal_replicas():
    # Expert 2 has two replicas on rank 1: rank 1's own pairs alternate between them, and so do rank 0's
    # (same node), starting at a different replica than rank 1.
    assert _slots(1, [2] * 4) == [3, 2, 3, 2]
    assert _slots(0, [2] * 4) == [2, 3, 2, 3]
    # Expert 1 (ranks 2 and 3) seen from node 0: remote replicas share the load evenly.
    counts = Counter(_slots(0, [1] * 10))
    assert counts == {4: 5, 7: 5}


def test_single_replica_goes_where_it_is():
    assert _slots(3, [3, 3]) == [1, 1]


def test_default_placement_replicates_the_first_experts():
    pmap = default_placement(2, 4, 6)
    assert pmap.tolist() == [[0, 1, 2, 3, 0, 1]] * 2
    assert slot_ranks(6, 3).tolist() == [0, 0, 1, 1, 2, 2]


def _apply(old, transfers):
    new = old.copy()
    for t in transfers:
        assert old[t.layer, t.src_slot] == t.expert  # the source really holds the expert
        new[t.layer, t.dst_slot] = t.expert
    return new


def test_migration_plan_turns_old_into_new():
    rng = np.random.default_rng(5)
    old = np.stack([rng.permutation(np.r_[np.arange(8), rng.integers(0, 8, 4)]) for _ in range(3)])
    new = np.stack([rng.permutation(np.r_[np.arange(8), rng.integers(0, 8, 4)]) for _ in range(3)])
    new[1] = old[1]  # an unchanged layer moves nothing
    transfers = plan_migration(old, new, world_size=4)
    assert {t.layer for t in transfers} <= {0, 2}
    np.testing.assert_array_equal(_apply(old, transfers), new)
    assert all(old[t.layer, t.dst_slot] != new[t.layer, t.dst_slot] for t in transfers)


def test_migration_prefers_local_copies_and_spreads_senders():
    old = np.array([[0, 1, 2, 3]])  # W = 2: ranks hold {0, 1} and {2, 3}
    new = np.array([[0, 0, 2, 0]])  # rank 0 copies expert 0 locally; rank 1 must fetch it
    transfers = plan_migration(old, new, world_size=2)
    by_slot = {t.dst_slot: t for t in transfers}
    assert by_slot[1].src_rank == 0 and by_slot[1].src_slot == 0
    assert by_slot[3].src_rank == 0
    # Two holders of expert 0, two slots needing it remotely: one copy from each.
    old = np.array([[0, 1, 0, 2, 3, 4, 5, 6]])
    new = np.array([[0, 1, 0, 2, 0, 4, 0, 6]])  # ranks 2 and 3 (two slots each, W=4) need expert 0
    sources = sorted(t.src_rank for t in plan_migration(old, new, world_size=4))
    assert sources == [0, 1]
