"""A new plan that moves few expert weights: start from the placement in force, not from scratch.

Moving an expert into a slot means copying its weights there, so the cost of a plan is the number
of slots whose expert changes. Per layer, in this order, the first of these that reaches the target
(balancedness within `tolerance` of a from-scratch solve) wins on moves:
1. the layer as it is (it needs no change);
2. a repair of it: change the fewest replica counts needed (a slot of an expert that has replicas
   to spare takes a replica of one that runs hot), then swap replicas off the busiest GPU one pair
   at a time until the target is met;
3. the from-scratch plan, its GPUs renamed to match the placement in force as closely as possible
   and each expert kept in its slot when it stays on its GPU (GPUs are interchangeable, so this
   costs no balance).
Of 2 and 3, the one with fewer moves is taken when both reach the target.

Sizes: L layers, E experts, P slots, W GPUs, N nodes, S = P // W slots per GPU.
"""

from __future__ import annotations

import numpy as np

from .placement_math import gpu_load, holders, placement_balancedness, replica_counts_of
from .packing import refine_by_swaps, replica_weights


def align_to_current(new: np.ndarray, current: np.ndarray, num_gpus: int, num_nodes: int = 1,
                     per_layer: bool = True) -> np.ndarray:
    """[L, P] new and current placements -> [L, P] new with its GPUs renamed (and experts kept in
    their slots) so that as many slots as possible keep their expert.

    Renaming keeps every per-GPU load and, with whole nodes renamed together, every per-node set:
    balancedness and the cross-GPU / cross-node shares do not change. `per_layer=False` renames
    all layers alike, which also keeps which GPU follows which between layers (affinity).
    """
    L, P = new.shape
    E = int(max(new.max(), current.max())) + 1
    W, N = num_gpus, num_nodes
    G = W // N
    S = P // W
    # overlap[l, a, b]: experts shared by new GPU a and current GPU b
    held_new = (holders(new, E, W) > 0).astype(np.float64)
    held_cur = (holders(current, E, W) > 0).astype(np.float64)
    overlap = np.einsum("lea,leb->lab", held_new, held_cur)  # [L, W, W], no BLAS threads
    if not per_layer:
        overlap = overlap.sum(axis=0, keepdims=True)
    rename = np.empty((overlap.shape[0], W), dtype=np.int64)  # new GPU a becomes GPU rename[a]
    for i, ov in enumerate(overlap):
        rename[i] = _match_gpus(ov, N, G)
    if not per_layer:
        rename = np.broadcast_to(rename, (L, W))
    renamed = np.empty_like(new)
    bins = new.reshape(L, W, S)
    out_bins = renamed.reshape(L, W, S)
    out_bins[np.arange(L)[:, None], rename] = bins
    return align_slots(renamed, current, num_gpus)


def _match_gpus(overlap: np.ndarray, num_nodes: int, gpus_per_node: int) -> np.ndarray:
    """[W, W] overlap -> [W] target GPU of each new GPU, nodes matched first, then GPUs inside."""
    from scipy.optimize import linear_sum_assignment  # imported on first use: see cost._nnls_fit

    W = overlap.shape[0]
    G = gpus_per_node
    if num_nodes == 1:
        rows, cols = linear_sum_assignment(-overlap)
        out = np.empty(W, dtype=np.int64)
        out[rows] = cols
        return out
    node_overlap = overlap.reshape(num_nodes, G, num_nodes, G).sum(axis=(1, 3))
    node_rows, node_cols = linear_sum_assignment(-node_overlap)
    out = np.empty(W, dtype=np.int64)
    for a_node, b_node in zip(node_rows, node_cols):
        block = overlap[a_node * G:(a_node + 1) * G, b_node * G:(b_node + 1) * G]
        rows, cols = linear_sum_assignment(-block)
        out[a_node * G + rows] = b_node * G + cols
    return out


def align_slots(new: np.ndarray, current: np.ndarray, num_gpus: int) -> np.ndarray:
    """[L, P] new and current placements -> [L, P] new with each GPU's experts reordered so that an
    expert already in a slot of that GPU stays in that slot (GPU contents unchanged)."""
    L, P = new.shape
    S = P // num_gpus
    E = int(max(new.max(), current.max())) + 1
    group = (np.arange(L)[:, None] * num_gpus + np.arange(P)[None, :] // S).ravel()  # (layer, GPU)
    key_new = _with_occurrence(group * E + new.ravel(), P)
    key_cur = _with_occurrence(group * E + current.ravel(), P)
    kept = np.isin(key_cur, key_new)  # slot whose current expert the new plan keeps on this GPU
    used = np.isin(key_new, key_cur)
    out = np.where(kept, current.ravel(), -1)
    # The rest of each GPU's new experts fill its other slots; both lists are in (layer, GPU) order.
    free_slots = np.flatnonzero(~kept)
    leftover = np.flatnonzero(~used)
    leftover = leftover[np.argsort(group[leftover], kind="stable")]
    out[free_slots] = new.ravel()[leftover]
    return out.reshape(L, P)


def _with_occurrence(keys: np.ndarray, bound: int) -> np.ndarray:
    """Flat keys -> keys * bound + (how many equal keys came before): repeated experts on one GPU
    stay distinct."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_keys)) + 1]
    run_start = np.repeat(starts, np.diff(np.r_[starts, keys.size]))
    occurrence = np.empty_like(keys)
    occurrence[order] = np.arange(keys.size) - run_start
    return keys * bound + occurrence


def fewest_count_changes(load: np.ndarray, counts: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """[L, E] load, [L, E] replica counts, [L] per-replica load limit -> [L, E] new counts.

    While some expert carries more than `limit` per replica, move one replica to it from the
    expert that can best spare one (smallest load per replica after giving one up), as long as
    that donor stays within the limit. Stops per layer when nothing is over, or no donor can.
    """
    load = np.asarray(load, dtype=np.float64)
    counts = counts.copy()
    L = load.shape[0]
    active = np.arange(L)
    while active.size:
        c = counts[active]
        lo = load[active]
        per = lo / c
        taker = np.argmax(per, axis=1)
        over = per[np.arange(active.size), taker] > limit[active]
        after = np.where(c >= 2, lo / np.maximum(c - 1, 1), np.inf)
        after[np.arange(active.size), taker] = np.inf
        giver = np.argmin(after, axis=1)
        can = over & (after[np.arange(active.size), giver] <= limit[active])
        rows = active[can]
        counts[rows, taker[can]] += 1
        counts[rows, giver[can]] -= 1
        active = rows
    return counts


def apply_count_changes(load: np.ndarray, pmap: np.ndarray, new_counts: np.ndarray, num_gpus: int,
                        num_nodes: int = 1) -> np.ndarray:
    """[L, E] load, [L, P] placement, [L, E] target counts -> [L, P] placement with those counts,
    rewriting only as many slots as counts change.

    An expert with replicas to spare gives up its slots on the lightest GPUs; the new replicas,
    heaviest first, take the freed slot on the lightest GPU that does not hold them (and, with
    several nodes, on a node that does not hold them)."""
    load = np.asarray(load, dtype=np.float64)
    out = pmap.copy()
    L, P = pmap.shape
    E = load.shape[1]
    S = P // num_gpus
    G = num_gpus // num_nodes
    current = replica_counts_of(pmap, E)
    change = new_counts - current
    per_gpu = gpu_load(load, pmap, num_gpus)
    new_weight = replica_weights(load, new_counts)
    for layer in np.flatnonzero((change != 0).any(axis=1)):
        row = out[layer]
        loads = per_gpu[layer].copy()
        freed: list[int] = []
        for expert in np.flatnonzero(change[layer] < 0):
            slots = np.flatnonzero(row == expert)
            lightest = slots[np.argsort(loads[slots // S], kind="stable")][: -change[layer, expert]]
            freed.extend(int(s) for s in lightest)
        old_weight = load[layer] / np.maximum(current[layer], 1)
        for s in freed:
            loads[s // S] -= old_weight[row[s]]
        takers = np.flatnonzero(change[layer] > 0)
        incoming = np.repeat(takers, change[layer, takers])
        incoming = incoming[np.argsort(-new_weight[layer, incoming], kind="stable")]
        free = np.array(freed, dtype=np.int64)
        open_ = np.ones(free.size, dtype=bool)
        gpus = free // S
        nodes = gpus // G
        # Which GPUs and nodes hold each expert, kept up to date as slots fill: a lookup per
        # incoming replica instead of searching the row (takers are never among the freed slots).
        on_gpu_of = np.zeros((E, num_gpus), dtype=bool)
        on_gpu_of[row, np.arange(P) // S] = True
        on_node_of = on_gpu_of.reshape(E, num_nodes, G).any(axis=2)
        for expert in incoming:
            on_gpu = on_gpu_of[expert, gpus]
            on_node = on_node_of[expert, nodes] if num_nodes > 1 else np.zeros(free.size, bool)
            key = loads[gpus] / (loads.sum() + 1.0) + 2.0 * on_gpu + 1.0 * on_node + 4.0 * ~open_
            pick = int(np.argmin(key))
            slot = int(free[pick])
            row[slot] = expert
            open_[pick] = False
            on_gpu_of[expert, slot // S] = True
            on_node_of[expert, slot // S // G] = True
            loads[slot // S] += new_weight[layer, expert]
    return out


def minimal_movement(load: np.ndarray, current: np.ndarray, scratch: np.ndarray, num_gpus: int,
                     num_nodes: int = 1, tolerance: float = 0.005) -> tuple[np.ndarray, dict]:
    """[L, E] load, [L, P] placement in force, [L, P] from-scratch plan for this load -> ([L, P]
    new plan, facts). Every layer of the new plan reaches (1 - tolerance) x the scratch plan's
    balancedness; facts name which way each layer went ("kept", "repaired", "renamed")."""
    load = np.asarray(load, dtype=np.float64)
    L, E = load.shape
    W = num_gpus
    target = placement_balancedness(load, scratch, W) * (1.0 - tolerance)
    mean = load.sum(axis=1) / W
    now = placement_balancedness(load, current, W)
    plan = current.copy()
    how = np.array(["kept"] * L, dtype=object)
    todo = np.flatnonzero(now < target)
    if todo.size == 0:
        return plan, {"how": how.tolist()}
    renamed = align_to_current(scratch[todo], current[todo], W, num_nodes, per_layer=True)
    # The repair: as few count changes as bring every replica under the scratch plan's heaviest
    # replica (within the tolerance), then single swaps until the target balancedness.
    scratch_heaviest = (load[todo] / replica_counts_of(scratch[todo], E)).max(axis=1)
    counts = fewest_count_changes(load[todo], replica_counts_of(current[todo], E),
                                  scratch_heaviest * (1.0 + tolerance))
    repaired = apply_count_changes(load[todo], current[todo], counts, W, num_nodes)
    target_max = mean[todo] / target[todo]
    repaired = refine_by_swaps(load[todo], repaired, W, num_nodes, target_max=target_max, pairs=False)
    repaired_ok = placement_balancedness(load[todo], repaired, W) >= target[todo]
    repaired_moves = (repaired != current[todo]).sum(axis=1)
    renamed_moves = (renamed != current[todo]).sum(axis=1)
    take_repair = repaired_ok & (repaired_moves <= renamed_moves)
    plan[todo] = np.where(take_repair[:, None], repaired, renamed)
    how[todo] = np.where(take_repair, "repaired", "renamed")
    return plan, {"how": how.tolist()}
