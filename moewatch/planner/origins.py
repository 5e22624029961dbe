"""Which rank gets which GPU block of a placement, given where tokens start.

Under dispatch-and-return all-to-all every layer starts from the token's own rank (its data-parallel
or attention rank), so a placement's blocks (the experts one GPU holds) cost least where the tokens
that use them start. An affinity placement groups experts that follow each other between layers,
but which GPU a group lands on is arbitrary; when tokens of one kind start on one rank (requests
served by one attention rank share a topic), handing each block to the rank whose tokens use it
most keeps those pairs local. Relabelling whole blocks keeps every balance property of the plan.

Sizes: L layers, E experts, P slots, W ranks (P divisible by W).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment


def rank_matrices(origin_load: np.ndarray, pmap: np.ndarray) -> np.ndarray:
    """[W, L, E] pairs from tokens starting on each rank, [L, P] placement -> [L, W, W] pairs rank i
    sends rank j, each expert's pairs split evenly over its replicas (as the runtime's nearest-replica
    choice does for a rank without a local one, on average)."""
    origin_load = np.asarray(origin_load, dtype=np.float64)
    pmap = np.asarray(pmap, dtype=np.int64)
    W, L, E = origin_load.shape
    P = pmap.shape[1]
    holders = np.zeros((L, E, W))
    for layer in range(L):
        np.add.at(holders[layer], (pmap[layer], np.arange(P) // (P // W)), 1.0)
    out = np.zeros((L, W, W))
    for layer in range(L):
        local = holders[layer] > 0  # [E, W]
        for src in range(W):
            # A rank that holds the expert keeps its pairs; otherwise they spread over the holders.
            keep = local[:, src]
            spread = holders[layer] / holders[layer].sum(axis=1, keepdims=True)
            share = np.where(keep[:, None], np.eye(W)[src][None, :], spread)
            out[layer, src] = origin_load[src, layer] @ share
    return out


def align_to_origins(pmap: np.ndarray, origin_load: np.ndarray) -> np.ndarray:
    """[L, P] placement, [W, L, E] pairs by starting rank -> the same placement with its GPU blocks
    handed to ranks (one permutation for all layers, so a group chained across layers moves whole)
    to keep the most pairs on their starting rank (a linear assignment)."""
    pmap = np.asarray(pmap, dtype=np.int64)
    origin_load = np.asarray(origin_load, dtype=np.float64)
    W, L, E = origin_load.shape
    L2, P = pmap.shape
    if L2 != L or P % W:
        raise ValueError(f"pmap: expected [{L}, P] with P divisible by {W}, got {list(pmap.shape)}")
    S = P // W
    blocks = pmap.reshape(L, W, S)
    gain = np.zeros((W, W))  # [block, rank] pairs kept local if the block sits on the rank
    for layer in range(L):
        for block in range(W):
            experts = np.unique(blocks[layer, block])
            gain[block] += origin_load[:, layer, experts].sum(axis=1)
    block_of_rank = np.empty(W, dtype=np.int64)
    rows, cols = linear_sum_assignment(-gain)
    block_of_rank[cols] = rows
    return blocks[:, block_of_rank].reshape(L, P)
