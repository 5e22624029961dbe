"""Handing a placement's GPU blocks to the ranks whose tokens use them (moewatch/planner/origins.py)."""

import numpy as np
import pytest

from moewatch.planner.origins import align_to_origins, rank_matrices
from moewatch.planner.placement_math import contiguous_placement


def test_blocks_go_to_the_rank_whose_tokens_use_them():
    L, E, W = 3, 8, 4
    pmap = contiguous_placement(L, E, E)  # block b holds experts 2b, 2b + 1
    origin = np.zeros((W, L, E))
    for rank in range(W):  # rank r's tokens use the experts of block (r + 1) % W
        block = (rank + 1) % W
        origin[rank, :, 2 * block:2 * block + 2] = 10.0
    aligned = align_to_origins(pmap, origin)
    for rank in range(W):
        held = set(aligned[0, 2 * rank:2 * rank + 2].tolist())
        assert held == {2 * ((rank + 1) % W), 2 * ((rank + 1) % W) + 1}
    # One permutation for every layer, blocks whole: the same experts, the same balance.
    assert all(sorted(aligned[layer]) == sorted(pmap[layer]) for layer in range(L))
    before, after = rank_matrices(origin, pmap), rank_matrices(origin, aligned)
    assert np.trace(after.sum(axis=0)) == pytest.approx(origin.sum())  # every pair local now
    assert np.trace(before.sum(axis=0)) == 0.0
    assert before.sum() == pytest.approx(origin.sum()) == pytest.approx(after.sum())


def test_rank_matrices_split_over_replicas_and_bad_shapes():
    pmap = np.array([[0, 1, 0, 2]])  # W = 2: rank 0 holds 0, 1; rank 1 holds 0, 2
    origin = np.zeros((2, 1, 3))
    origin[0, 0] = [4, 0, 6]  # rank 0: expert 0 (local), expert 2 (on rank 1)
    origin[1, 0] = [2, 8, 0]  # rank 1: expert 0 (local), expert 1 (on rank 0)
    m = rank_matrices(origin, pmap)[0]
    assert np.allclose(m, [[4, 6], [8, 2]])
    with pytest.raises(ValueError, match="pmap"):
        align_to_origins(np.zeros((2, 3), dtype=int), np.zeros((2, 1, 3)))
