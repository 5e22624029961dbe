"""The replica cap, a planner option: capped counts still fill every slot, and solve_placement(max_replicas=...)
gives no expert more slots than the cap while keeping the placement valid and aligned to the current one."""

from __future__ import annotations

import numpy as np
import pytest

from moewatch.checks import is_valid_placement
from moewatch.planner import placement_math as metrics, solve_placement
from moewatch.planner.replicate import capped_replica_counts
from moewatch.planner.placement_math import PlacementShapeError

E, P = 8, 12


@pytest.mark.parametrize("values", [(8, 3), (1, 1)])
def test_capped_replica_counts_sum_to_slots(values):
    cap, hot = values
    load = np.ones((2, E))
    load[:, 0] = 100
    counts = capped_replica_counts(load, P, cap)
    assert (counts.sum(axis=1) == P).all()
    assert counts.max() <= max(cap, -(-P // E))


def test_solve_placement_keeps_each_expert_under_the_cap():
    load = np.full((2, E), 100.0)
    load[:, 0] = 5000  # uncapped, the hot expert takes most spare slots
    current = np.tile(np.arange(P) % E, (2, 1))
    free = solve_placement(load, 4, P, current=current)
    assert metrics.replica_counts_of(free.physical_to_logical_map, E).max() > 2
    capped = solve_placement(load, 4, P, current=current, max_replicas=2)
    pmap = capped.physical_to_logical_map
    counts = metrics.replica_counts_of(pmap, E)
    assert counts.max() == 2 and (counts.sum(axis=1) == P).all()
    assert is_valid_placement(pmap, E, 4)
    # Aligned to the current placement: slots that can keep their expert do.
    assert (metrics.experts_moved(current, pmap) < P).all()
    # A cap the fixed slots cannot meet rises to ceil(P / E) rather than leave a slot empty.
    assert metrics.replica_counts_of(solve_placement(load, 4, P, max_replicas=1).physical_to_logical_map,
                                     E).max() == 2
    with pytest.raises(PlacementShapeError, match="max_replicas"):
        solve_placement(load, 4, P, max_replicas=0)
