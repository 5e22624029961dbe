"""DeepSeek's EPLB, written here from its published description, for the comparison only.

The published algorithm (github.com/deepseek-ai/EPLB, README and docstrings), re-derived in numpy:
- balanced packing: items in decreasing weight each go to the lightest pack that still has room,
  every pack taking the same number of items;
- replication: each extra slot goes to the expert with the largest load per replica;
- hierarchical policy (expert groups divide over nodes): pack expert groups onto nodes, replicate
  inside each node, pack the node's replicas onto its GPUs;
- global policy (otherwise): replicate over all slots and pack onto all GPUs, ignoring groups.
No line of the original is copied; its loops over single items are kept as loops, so the running
time here says what that greedy costs in numpy, not what the torch original costs.

Sizes: L layers, E logical experts, P physical slots, W GPUs, N nodes, X rows of independent
problems.
"""

from __future__ import annotations

import numpy as np


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """[X, n] item weights -> ([X, n] pack of each item, [X, n] its position in the pack).
    Every pack takes n / num_packs items."""
    X, n = weight.shape
    per_pack = n // num_packs
    pack_of = np.empty((X, n), dtype=np.int64)
    rank_in_pack = np.empty((X, n), dtype=np.int64)
    if per_pack == 1:
        pack_of[:] = np.arange(n)
        rank_in_pack[:] = 0
        return pack_of, rank_in_pack
    for x in range(X):
        pack_weight = [0.0] * num_packs
        pack_items = [0] * num_packs
        for item in np.argsort(-weight[x], kind="stable"):
            open_packs = [p for p in range(num_packs) if pack_items[p] < per_pack]
            pack = min(open_packs, key=pack_weight.__getitem__)
            pack_of[x, item] = pack
            rank_in_pack[x, item] = pack_items[pack]
            pack_weight[pack] += float(weight[x, item])
            pack_items[pack] += 1
    return pack_of, rank_in_pack


def replicate_experts(weight: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[X, n] logical loads -> ([X, num_physical] logical expert of each physical one, [X,
    num_physical] replica index, [X, n] replica counts)."""
    X, n = weight.shape
    phy2log = np.tile(np.arange(num_physical, dtype=np.int64), (X, 1))
    replica_rank = np.zeros((X, num_physical), dtype=np.int64)
    counts = np.ones((X, n), dtype=np.int64)
    rows = np.arange(X)
    for slot in range(n, num_physical):
        hottest = np.argmax(weight / counts, axis=1)
        phy2log[:, slot] = hottest
        replica_rank[:, slot] = counts[rows, hottest]
        counts[rows, hottest] += 1
    return phy2log, replica_rank, counts


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def rebalance_hierarchical(weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int,
                           num_gpus: int) -> np.ndarray:
    """[L, E] load -> [L, P] physical_to_logical_map, by the hierarchical policy."""
    L, E = weight.shape
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    slots_per_gpu = num_physical // num_gpus
    # 1. expert groups onto nodes
    group_load = weight.reshape(L, num_groups, group_size).sum(axis=2)
    group_node, group_rank = balanced_packing(group_load, num_nodes)
    # "node-major" logical ids: node 0's experts first, in the order their groups were packed
    log2mlog = (((group_node * groups_per_node + group_rank) * group_size)[:, :, None]
                + np.arange(group_size)).reshape(L, E)
    mlog2log = _inverse(log2mlog)
    # 2. replicas inside each node
    node_load = np.take_along_axis(weight, mlog2log, axis=1).reshape(L * num_nodes, E // num_nodes)
    phy2mlog, _, mlog_count = replicate_experts(node_load, num_physical // num_nodes)
    # 3. each node's replicas onto its GPUs
    replica_load = np.take_along_axis(node_load / mlog_count, phy2mlog, axis=1)
    gpu_of, rank_on_gpu = balanced_packing(replica_load, num_gpus // num_nodes)
    phy2pphy = gpu_of * slots_per_gpu + rank_on_gpu
    pphy2mlog = np.take_along_axis(phy2mlog, _inverse(phy2pphy), axis=1)
    pphy2mlog = (pphy2mlog.reshape(L, num_nodes, -1)
                 + np.arange(0, E, E // num_nodes)[None, :, None]).reshape(L, -1)
    return np.take_along_axis(mlog2log, pphy2mlog, axis=1)


def rebalance_global(weight: np.ndarray, num_physical: int, num_gpus: int) -> np.ndarray:
    """[L, E] load -> [L, P] placement, by the global policy (one group, one node)."""
    return rebalance_hierarchical(weight, num_physical, 1, 1, num_gpus)


def rebalance(weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int,
              num_gpus: int) -> np.ndarray:
    """EPLB's entry point: hierarchical when the groups divide over the nodes, else global."""
    weight = np.asarray(weight, dtype=np.float64)
    if num_groups % num_nodes == 0:
        return rebalance_hierarchical(weight, num_physical, num_groups, num_nodes, num_gpus)
    return rebalance_global(weight, num_physical, num_gpus)
