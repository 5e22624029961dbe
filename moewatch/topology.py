"""Nodes: which pairs cross the slower inter-node link, and what moving an expert across it costs.

An EP group of W ranks spans N = W / G nodes of G ranks (`ranks_per_node` in the hello and every
window); rank r sits on node r // G (docs/telemetry.md). Inside a node ranks share a fast interconnect
(NVLink class); across nodes the all-to-all goes over the network (RDMA), several times slower
([serving-2026]: ~700 GB/s against ~22 GB/s). So a group that spans nodes is judged, and planned, on its
cross-node traffic: the comm-bound case of [serving-2026] is the cross-node all-to-all, and the remedy is a
node-aware placement that keeps a token's experts inside its node.

Pure functions of arrays (numpy only), shared by the triage, the exporters and the agent's policy.
"""

from __future__ import annotations

import numpy as np

from .planner.placement_math import dispatch_cross_share, dispatch_cross_shares


def num_nodes(world_size: int, ranks_per_node: int) -> int:
    """Nodes the group spans; 1 when ranks_per_node does not split the group evenly (one fabric)."""
    if ranks_per_node <= 0 or world_size % ranks_per_node:
        return 1
    return max(1, world_size // ranks_per_node)


def node_of_rank(world_size: int, ranks_per_node: int) -> np.ndarray:
    """[W] node index of each rank."""
    return np.arange(world_size) // max(1, world_size // num_nodes(world_size, ranks_per_node))


def cross_node_pairs(traffic: np.ndarray, ranks_per_node: int) -> np.ndarray:
    """[L, W, W] pairs from rank i to rank j -> [L] pairs whose source and slot sit on different nodes."""
    traffic = np.asarray(traffic)
    if traffic.dtype.kind in "iu":
        # Counts: what crossed is what did not stay inside a node's diagonal block (exact in integers,
        # without an [L, W, W] product).
        nodes = num_nodes(traffic.shape[1], ranks_per_node)  # as node_of_rank splits the matrix
        size = traffic.shape[1] // nodes
        blocks = traffic.reshape(traffic.shape[0], nodes, size, nodes, size)
        return traffic.sum(axis=(1, 2)) - np.diagonal(blocks, axis1=1, axis2=3).sum(axis=(1, 2, 3))
    node = node_of_rank(traffic.shape[1], ranks_per_node)
    across = node[:, None] != node[None, :]
    return (traffic * across[None, :, :]).sum(axis=(1, 2))


def cross_node_ratio(traffic: np.ndarray | None, world_size: int, ranks_per_node: int,
                     num_layers: int) -> np.ndarray | None:
    """[L, W, W] traffic (or None) -> [L] share of computed pairs that crossed nodes (0 when idle).

    A single-node group crosses none. None when the group spans nodes but the traffic matrix is
    absent: the node split of the sent pairs is then unknown (absent evidence, never guessed)."""
    if num_nodes(world_size, ranks_per_node) == 1:
        return np.zeros(num_layers)
    if traffic is None:
        return None
    traffic = np.asarray(traffic)
    total = traffic.sum(axis=(1, 2)).astype(np.float64)
    crossed = cross_node_pairs(traffic, ranks_per_node).astype(np.float64)
    return np.divide(crossed, total, out=np.zeros_like(total), where=total > 0)


def expected_cross_node_ratio(expert_tokens: np.ndarray, pmap: np.ndarray, world_size: int,
                              ranks_per_node: int) -> np.ndarray:
    """[L, E] pairs per expert, [L, P] placement -> [L] cross-node share the placement predicts with
    tokens even over ranks and the runtime's replica choice (own rank, own node, any)."""
    return dispatch_cross_share(np.asarray(expert_tokens, dtype=np.float64), np.asarray(pmap),
                                num_nodes(world_size, ranks_per_node))


def cross_node_evidence(ratio: float | None, expected: float | None, world_size: int, ranks_per_node: int,
                        comm_bound: bool, margin: float) -> str | None:
    """The triage's sentence on cross-node traffic, for a group that spans nodes (None otherwise)."""
    nodes = num_nodes(world_size, ranks_per_node)
    if nodes == 1:
        return None
    layout = f"{nodes} nodes of {world_size // nodes} ranks"
    if ratio is None:
        return f"Cross-node share unknown ({layout}): the window carries no rank-to-rank traffic."
    text = f"{ratio:.0%} of pairs cross nodes over the inter-node (RDMA) link ({layout})"
    if expected is not None:
        text += f"; the placement predicts {expected:.0%}"
    if comm_bound and expected is not None and ratio > expected + margin:
        return text + ": the placement sends traffic across nodes that a node-aware plan would keep inside them."
    if comm_bound and ratio > 0:
        return text + ": the cross-node all-to-all is the slow part; replicas on every node keep pairs local."
    return text + "."


def migration_seconds(old_row: np.ndarray, new_row: np.ndarray, world_size: int, ranks_per_node: int,
                      expert_bytes: float, intra_bytes_per_second: float,
                      inter_bytes_per_second: float) -> float:
    """[P] placement before and after (one layer) -> seconds to fill the slots that change.

    A changed slot is filled from a holder of its new expert under the old placement: on its own
    node when there is one (the fast link, a copy on the same rank included), else across nodes at
    the slower inter-node bandwidth. Transfers are summed (a conservative, serial estimate)."""
    return float(layer_migration_seconds(np.asarray(old_row)[None], np.asarray(new_row)[None], world_size,
                                         ranks_per_node, expert_bytes, intra_bytes_per_second,
                                         inter_bytes_per_second)[0])


def layer_migration_seconds(old: np.ndarray, new: np.ndarray, world_size: int, ranks_per_node: int,
                            expert_bytes: float, intra_bytes_per_second: float,
                            inter_bytes_per_second: float) -> np.ndarray:
    """[L, P] placements before and after -> [L] seconds to fill each layer's changed slots, as
    migration_seconds prices one layer."""
    old, new = np.asarray(old), np.asarray(new)
    L, P = old.shape
    node = node_of_rank(world_size, ranks_per_node)
    slot_node = node[np.arange(P) // (P // world_size)]
    nodes = int(node.max()) + 1
    experts = int(max(old.max(), new.max())) + 1
    held = np.zeros((L, experts, nodes), dtype=bool)  # [layer, expert, node] under the old placement
    held[np.arange(L)[:, None], old, slot_node[None, :]] = True
    near = held[np.arange(L)[:, None], new, slot_node[None, :]]  # [L, P] a holder on the slot's node
    per_slot = np.where(near, expert_bytes / intra_bytes_per_second, expert_bytes / inter_bytes_per_second)
    return np.where(old != new, per_slot, 0.0).sum(axis=1)
