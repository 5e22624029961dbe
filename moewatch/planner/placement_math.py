"""What a placement is worth: per-GPU load, balancedness, cross-GPU and cross-node shares, movement.

Sizes in docstrings: L layers, E logical experts, P physical slots, W GPUs (ranks), N nodes,
S = P // W slots per GPU, G = W // N GPUs per node. Slot s lives on GPU s // S (docs/telemetry.md), GPU g on
node g // G.

Conventions (docs/planner.md): an expert's load is split evenly over its replicas; balancedness of a layer
is mean over max of per-GPU load (1.0 for an idle layer). For the shares, tokens start evenly over
the ranks and the runtime picks a replica on its own rank, else on its own node, else any.
"""

from __future__ import annotations

import numpy as np

from .. import checks
from ..errors import InputError


class PlacementShapeError(InputError):
    """Sizes that do not fit together; `field` names the offending input."""


def check_sizes(num_experts: int, num_slots: int, num_gpus: int, num_nodes: int = 1) -> None:
    """Raise PlacementShapeError unless W >= 1, N divides W, E <= P and W divides P."""
    checks.check_at_least_one([("num_gpus", num_gpus)], PlacementShapeError)
    checks.check_num_nodes(num_gpus, num_nodes, PlacementShapeError)
    checks.check_slots_hold_experts(num_slots, num_experts, PlacementShapeError)
    checks.check_slots_divide(num_slots, num_gpus, PlacementShapeError, ranks="GPUs")


def replica_counts_of(pmap: np.ndarray, num_experts: int) -> np.ndarray:
    """[L, P] placement -> [L, E] number of slots holding each expert."""
    L = pmap.shape[0]
    flat = (pmap + (np.arange(L) * num_experts)[:, None]).ravel()
    return np.bincount(flat, minlength=L * num_experts).reshape(L, num_experts)


def slot_load(load: np.ndarray, pmap: np.ndarray) -> np.ndarray:
    """[L, E] load, [L, P] placement -> [L, P] load each slot computes (even split over replicas)."""
    counts = replica_counts_of(pmap, load.shape[1])
    per_replica = np.divide(load, counts, out=np.zeros(load.shape, dtype=np.float64), where=counts > 0)
    return np.take_along_axis(per_replica, pmap, axis=1)


def gpu_load(load: np.ndarray, pmap: np.ndarray, num_gpus: int) -> np.ndarray:
    """[L, E] load, [L, P] placement -> [L, W] load per GPU."""
    L, P = pmap.shape
    return slot_load(load, pmap).reshape(L, num_gpus, P // num_gpus).sum(axis=2)


def balancedness_of_gpu_load(per_gpu: np.ndarray) -> np.ndarray:
    """[L, W] load per GPU -> [L] mean / max (1.0 where a layer is idle)."""
    hi = per_gpu.max(axis=1)
    out = np.ones(per_gpu.shape[0])
    np.divide(per_gpu.mean(axis=1), hi, out=out, where=hi > 0)
    return out


def placement_balancedness(load: np.ndarray, pmap: np.ndarray, num_gpus: int) -> np.ndarray:
    """[L, E] load, [L, P] placement -> [L] balancedness."""
    return balancedness_of_gpu_load(gpu_load(load, pmap, num_gpus))


def normalised_rank_speed(rank_speed: object, num_gpus: int) -> np.ndarray:
    """[W] positive finite speeds, any scale (pairs per second, relative) -> [W] float64 with mean 1;
    exactly 1.0 each when all are equal, so equal speeds can be recognised without rounding.
    Raises PlacementShapeError("rank_speed", ...) for a wrong length or a bad value."""
    try:
        arr = np.asarray(rank_speed, dtype=np.float64)
    except (TypeError, ValueError):
        raise PlacementShapeError("rank_speed", "expected a list of numbers, one per GPU") from None
    if arr.ndim != 1 or arr.shape[0] != num_gpus:
        raise PlacementShapeError("rank_speed", f"expected {num_gpus} speeds (one per GPU), got shape {list(arr.shape)}")
    if not np.all(np.isfinite(arr)):
        raise PlacementShapeError("rank_speed", "speeds must be finite")
    if np.any(arr <= 0):
        raise PlacementShapeError("rank_speed", "speeds must be > 0")
    if np.all(arr == arr[0]):
        return np.ones(num_gpus)
    return arr / arr.mean()


def time_balancedness_of_gpu_load(per_gpu: np.ndarray, rank_speed: np.ndarray) -> np.ndarray:
    """[L, W] load per GPU, [W] speeds -> [L] mean / max of the GPUs' predicted times (load / speed);
    1.0 where a layer is idle or every GPU finishes together."""
    return balancedness_of_gpu_load(per_gpu / rank_speed[None, :])


def placement_time_balancedness(load: np.ndarray, pmap: np.ndarray, rank_speed: np.ndarray) -> np.ndarray:
    """[L, E] load, [L, P] placement, [W] speeds -> [L] time balancedness (W = len(rank_speed))."""
    return time_balancedness_of_gpu_load(gpu_load(load, pmap, rank_speed.shape[0]), rank_speed)


def repeats_only_as_padding(pmap: np.ndarray, num_experts: int, num_gpus: int) -> np.ndarray:
    """[L, P] placement -> [L] True where every expert that a GPU holds twice or more is held by
    no other GPU. The runtime sends a pair to a replica on its own rank first, so a second local
    copy of a shared expert would not take the share the even-split model gives it; copies that
    all sit on one GPU (padding) take that GPU's whole load in both views."""
    held = holders(pmap, num_experts, num_gpus)  # [L, E, W]
    repeated = held.max(axis=2) > 1
    shared = (held > 0).sum(axis=2) > 1
    return ~(repeated & shared).any(axis=1)


def holders(pmap: np.ndarray, num_experts: int, num_groups: int) -> np.ndarray:
    """[L, P] placement -> [L, E, num_groups] replicas of each expert per group of consecutive slots
    (num_groups = W gives per GPU, = N per node)."""
    L, P = pmap.shape
    group_of_slot = np.arange(P) // (P // num_groups)
    flat = ((np.arange(L)[:, None] * num_experts + pmap) * num_groups + group_of_slot[None, :]).ravel()
    return np.bincount(flat, minlength=L * num_experts * num_groups).reshape(L, num_experts, num_groups)


def holder_counts(pmap: np.ndarray, num_experts: int, num_groups: int) -> np.ndarray:
    """[L, P] placement -> [L, E] how many groups of consecutive slots hold each expert: the same as
    (holders(...) > 0).sum(axis=2). With a few slots per group (a GPU's), a slot's expert is compared
    with the slots before it in its group, instead of filling an [L, E, groups] table."""
    L, P = pmap.shape
    size = P // num_groups
    if size > FEW_SLOTS_PER_GROUP:
        return (holders(pmap, num_experts, num_groups) > 0).sum(axis=2)
    grouped = pmap.reshape(L, num_groups, size)
    repeat = np.zeros(grouped.shape, dtype=bool)  # the expert sits on an earlier slot of the group
    for k in range(1, size):
        repeat[:, :, k:] |= grouped[:, :, k:] == grouped[:, :, :-k]
    expert_of_layer = np.arange(L)[:, None] * num_experts + pmap
    return np.bincount(expert_of_layer[~repeat.reshape(L, P)], minlength=L * num_experts).reshape(L, num_experts)


FEW_SLOTS_PER_GROUP = 16  # beyond, the [L, E, groups] table costs less than one comparison per offset


def dispatch_cross_shares(load: np.ndarray, pmap: np.ndarray, num_gpus: int,
                          num_nodes: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """[L, E] load, [L, P] placement -> ([L] cross-GPU share, [L] cross-node share) of the pairs.

    A token on rank r going to expert e stays on r when r holds e, else stays on r's node when the
    node holds e: with tokens even over ranks, expert e leaves the rank with probability
    1 - (ranks holding e) / W and leaves the node with probability 1 - (nodes holding e) / N.
    """
    return dispatch_cross_share(load, pmap, num_gpus), dispatch_cross_share(load, pmap, num_nodes)


def dispatch_cross_share(load: np.ndarray, pmap: np.ndarray, num_groups: int) -> np.ndarray:
    """[L, E] load, [L, P] placement -> [L] share of the pairs that leave their group of consecutive
    slots (num_groups = W: the GPU, = N: the node); one half of `dispatch_cross_shares`, for a caller
    that needs one (the per-GPU count is the costly one: L x E x W)."""
    held = holder_counts(pmap, load.shape[1], num_groups)
    total = load.sum(axis=1)
    safe = np.where(total > 0, total, 1.0)
    share = (load * (1.0 - held / num_groups)).sum(axis=1) / safe
    share[total <= 0] = 0.0
    return share


def transition_cross_shares(transitions: np.ndarray, pmap: np.ndarray, num_gpus: int,
                            num_nodes: int = 1) -> tuple[float, float]:
    """[L-1, E, E] transition counts, [L, P] placement -> (cross-GPU share, cross-node share).

    transitions[l, i, j] counts a token's consecutive-layer pairs (expert i at layer l, expert j at
    layer l + 1). Where the token stays on its expert's GPU between layers (ExFlow's execution), the
    pair stays on the GPU when a replica of i (each taken with probability 1 / replicas) sits on a
    GPU that holds j, and on the node likewise.
    """
    E = transitions.shape[1]
    total = float(transitions.sum())
    if total <= 0:
        return 0.0, 0.0
    same_gpu = _same_group_pairs(transitions, pmap, E, num_gpus)
    same_node = _same_group_pairs(transitions, pmap, E, num_nodes)
    return 1.0 - same_gpu / total, 1.0 - same_node / total


def _same_group_pairs(transitions: np.ndarray, pmap: np.ndarray, num_experts: int, num_groups: int) -> float:
    # pairs (i at l, j at l+1) stay when the group of i's token holds j:
    # sum over l, i, g of share[l, i, g] * reach[l, i, g]
    counts = replica_counts_of(pmap[:-1], num_experts)
    share = holders(pmap[:-1], num_experts, num_groups) / np.maximum(counts, 1)[:, :, None]
    return float((share * pairs_reaching_groups(transitions, pmap[1:], num_groups)).sum())


def pairs_reaching_groups(transitions: np.ndarray, next_pmap: np.ndarray, num_groups: int) -> np.ndarray:
    """[A, E, E] transitions (source, destination), [A, P] placement of the destination layers ->
    [A, E, groups]: pairs from each source expert whose destination the group holds.

    Gathers columns by slot instead of multiplying by a 0/1 matrix: no BLAS call, whose threads
    crawl when the CPUs are shared (the sidecar's normal case)."""
    A, P = next_pmap.shape
    E = transitions.shape[1]
    first = first_in_group(next_pmap, num_groups)  # an expert twice in one group counts once
    cols = np.take_along_axis(transitions, np.broadcast_to(next_pmap[:, None, :], (A, E, P)), axis=2)
    cols = cols * first[:, None, :]
    return cols.reshape(A, E, num_groups, P // num_groups).sum(axis=3)


def pairs_from_groups(transitions: np.ndarray, prev_pmap: np.ndarray, num_groups: int) -> np.ndarray:
    """[A, E, E] transitions (source, destination), [A, P] placement of the source layers ->
    [A, E, groups]: pairs into each destination expert whose token sits in the group (a source
    expert's tokens split evenly over its replicas)."""
    A, P = prev_pmap.shape
    E = transitions.shape[1]
    counts = np.maximum(replica_counts_of(prev_pmap, E), 1)
    rows = np.take_along_axis(transitions, np.broadcast_to(prev_pmap[:, :, None], (A, P, E)), axis=1)
    rows = rows / np.take_along_axis(counts, prev_pmap, axis=1)[:, :, None]
    return np.swapaxes(rows.reshape(A, num_groups, P // num_groups, E).sum(axis=2), 1, 2)


def first_in_group(pmap: np.ndarray, num_groups: int) -> np.ndarray:
    """[L, P] placement -> [L, P] True where the slot is its expert's first in its group of slots."""
    L, P = pmap.shape
    size = P // num_groups
    grouped = pmap.reshape(L, num_groups, size)
    order = np.argsort(grouped, axis=2, kind="stable")
    sorted_ = np.take_along_axis(grouped, order, axis=2)
    first_sorted = np.ones_like(sorted_, dtype=bool)
    first_sorted[:, :, 1:] = sorted_[:, :, 1:] != sorted_[:, :, :-1]
    out = np.empty_like(first_sorted)
    np.put_along_axis(out, order, first_sorted, axis=2)
    return out.reshape(L, P)


def experts_moved(current: np.ndarray, new: np.ndarray) -> np.ndarray:
    """[L, P] current and new placements -> [L] slots whose expert changes (weights to load)."""
    return (current != new).sum(axis=1)


def contiguous_placement(num_layers: int, num_experts: int, num_slots: int) -> np.ndarray:
    """[L, P] the runtimes' default: slot s holds expert s mod E (experts in order, extra slots
    holding the first experts again)."""
    return np.broadcast_to(np.arange(num_slots) % num_experts, (num_layers, num_slots)).copy()
