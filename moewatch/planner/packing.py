"""Replicas onto GPUs: exactly S = P // W slots per GPU, lightest-first, then swaps off the busiest GPU.

Two steps, both vectorised over layers:
1. `lpt_pack`: replicas in decreasing load go to the lightest GPU with a free slot (longest
   processing time first, DeepSeek's EPLB packing, [deepseek-eplb]), preferring a GPU that does not hold the expert
   yet and, with several nodes, a node that does not hold it yet: spreading replicas over nodes is
   what lets the runtime's "own rank, then own node" choice keep pairs inside a node.
2. `refine_by_swaps`: while some swap of one replica on the busiest GPU with one replica elsewhere
   lowers the busiest GPU without raising the other to its old load, make the best one. Swaps never
   put two replicas of an expert on one GPU and never take an expert off a node it is alone on
   unless it already sits on the destination node, so the spread from step 1 is kept.
Each swap strictly lowers the sorted vector of GPU loads, so the loop ends.
"""

from __future__ import annotations

import numpy as np

from .mending_compiled import kernel
from .placement_math import holders, replica_counts_of

# Candidate swaps are evaluated [layers, S, W, S] at a time; keep one block under this many.
_SWAP_BLOCK_ELEMENTS = 1 << 21
# A swap must lower the busiest GPU of its pair by more than this share of its load.
_TOL = 1e-9
# A layer whose busiest GPU is within this share of the lower bound is left as it is.
_GAP = 1e-3
# How many pairings of busy with idle GPUs to try before the one-swap-at-a-time rounds.
_PAIR_OFFSETS = 1
# Rounds off the busiest GPU look at this many idlest GPUs first.
_TOP_PARTNERS = 8


def replica_weights(load: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[L, E] load and replica counts -> [L, E] load each replica carries."""
    return np.divide(load, counts, out=np.zeros(load.shape, dtype=np.float64), where=counts > 0)


def replicas_in_order(load: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[L, E] load and counts (rows summing to P) -> ([L, P] expert of each replica, [L, P] its
    load), heaviest first; replicas of one expert stay together."""
    L, E = load.shape
    P = int(counts[0].sum())
    experts = np.repeat(np.tile(np.arange(E), L), counts.ravel()).reshape(L, P)
    weights = np.take_along_axis(replica_weights(load, counts), experts, axis=1)
    order = np.argsort(-weights, axis=1, kind="stable")
    return np.take_along_axis(experts, order, axis=1), np.take_along_axis(weights, order, axis=1)


def lpt_pack(load: np.ndarray, counts: np.ndarray, num_gpus: int, num_nodes: int = 1) -> np.ndarray:
    """[L, E] load, [L, E] replica counts -> [L, P] placement, S slots per GPU.

    Each replica, heaviest first, goes to the GPU with a free slot that (1) does not hold the
    expert, (2) sits on a node that does not hold it (only with num_nodes > 1), (3) is lightest;
    the first GPU on ties.
    """
    load = np.asarray(load, dtype=np.float64)
    L, E = load.shape
    P = int(counts[0].sum())
    W = num_gpus
    S = P // W
    G = W // num_nodes
    rows = np.arange(L)
    items, weights = replicas_in_order(load, counts)
    if (counts == 1).all():
        return _pack_in_waves(items, weights, W)
    total = load.sum(axis=1)
    # key[l, g] = GPU load scaled into [0, 1) + 4 when full; + 2 when the GPU holds the expert and
    # + 1 when its node does. The integer flags dominate the scaled load: a lexicographic order.
    # Flat arrays and row gathers: this loop runs P times, so each numpy call counts.
    scaled = (weights / (total * (1.0 + 1e-9) + 1.0)[:, None]).T.copy()  # [P, L]
    expert_rows = (items + (rows * E)[:, None]).T.copy()  # [P, L] row of (layer, expert)
    compiled = kernel()
    if compiled is not None:  # the same loop compiled (mending_compiled.py): the same placement
        gpu_of_item = compiled.lpt_assign(scaled, expert_rows, W, num_nodes, S, L * E)
        order = np.argsort(gpu_of_item.T, axis=1, kind="stable")
        return np.take_along_axis(items, order, axis=1)
    key = np.zeros(L * W)
    key2d = key.reshape(L, W)
    fill = np.zeros(L * W, dtype=np.int64)
    # penalty[(l, e), g]: 2 when GPU g holds expert e of layer l, + 1 when its node does (one gather
    # per replica instead of one per flag; a GPU that holds the expert is on a node that does).
    penalty = np.zeros((L * E, W))
    by_node = penalty.reshape(L * E, num_nodes, G)
    flag = 3.0 if num_nodes > 1 else 2.0
    node_of_gpu = np.arange(W) // G
    row_start = rows * W
    gpu_of_item = np.empty((P, L), dtype=np.int64)
    for k in range(P):
        le = expert_rows[k]
        pen = penalty.take(le, axis=0)
        pen += key2d
        gpu = np.argmin(pen, axis=1)
        gpu_of_item[k] = gpu
        at = row_start + gpu
        filled = fill[at] + 1
        fill[at] = filled
        key[at] += scaled[k] + 4.0 * (filled == S)
        if num_nodes > 1:
            node = by_node[le, node_of_gpu[gpu]]  # [L, G]
            np.maximum(node, 1.0, out=node)
            by_node[le, node_of_gpu[gpu]] = node
        penalty.ravel()[le * W + gpu] = flag
    # Each GPU's S replicas fill its slots in the order they arrived.
    order = np.argsort(gpu_of_item.T, axis=1, kind="stable")
    return np.take_along_axis(items, order, axis=1)


def _pack_in_waves(items: np.ndarray, weights: np.ndarray, num_gpus: int) -> np.ndarray:
    """[L, P] items heaviest first (no expert twice) -> [L, P] placement: each wave of W items
    goes heaviest to lightest GPU. Without replicas no GPU or node can hold an expert twice, so
    nothing else matters, and a wave at a time is W times fewer steps than one item at a time."""
    L, P = items.shape
    W = num_gpus
    rows = np.arange(L)[:, None]
    loads = np.zeros((L, W))
    gpu_of_item = np.empty((L, P), dtype=np.int64)
    for start in range(0, P, W):
        order = np.argsort(loads, axis=1, kind="stable")
        gpu_of_item[:, start:start + W] = order
        loads[rows, order] += weights[:, start:start + W]
    order = np.argsort(gpu_of_item, axis=1, kind="stable")
    return np.take_along_axis(items, order, axis=1)


def refine_by_swaps(load: np.ndarray, pmap: np.ndarray, num_gpus: int, num_nodes: int = 1,
                    max_rounds: int = 400, layers: np.ndarray | None = None,
                    target_max: np.ndarray | None = None, pairs: bool = True) -> np.ndarray:
    """[L, E] load, [L, P] placement -> [L, P] placement with the same replica counts and a busiest
    GPU no heavier (usually lighter).

    First rounds (when `pairs`) pair the i-th busiest GPU with the i-th idlest and make the best
    swap in every pair at once (cheap, moves most of the way); then rounds make the best swap off
    the busiest GPU alone, with any other GPU, until none helps. Only `layers` (indices) are
    touched when given. A layer is finished once its busiest GPU is within 0.1 % of the lower
    bound max(mean GPU load, heaviest replica), or at or under `target_max` [L] when given (the
    movement planner stops there: every swap costs two expert moves).
    """
    load = np.asarray(load, dtype=np.float64)
    pmap = np.array(pmap, dtype=np.int64, copy=True)
    if num_gpus < 2:
        return pmap
    state = _SwapState(load, pmap, num_gpus, num_nodes)
    if target_max is not None:
        state.bound = np.asarray(target_max, dtype=np.float64)
    active = np.arange(load.shape[0]) if layers is None else np.asarray(layers, dtype=np.int64)
    rounds = 0
    # Pairings: the i-th busiest GPU with the (i + offset)-th idlest; a new offset when one stalls.
    for offset in range(min(_PAIR_OFFSETS, num_gpus // 2) if pairs else 0):
        pair_active = state.unfinished(active)
        while pair_active.size and rounds < max_rounds:
            pair_active = state.pair_round(pair_active, offset)
            rounds += 1
    active = state.unfinished(active)
    while active.size and rounds < max_rounds:
        active = state.unfinished(np.concatenate([state.top_round(chunk) for chunk in state.chunks(active)]))
        rounds += 1
    return pmap


class _SwapState:
    """The placement being refined, as bins [L, W, S] (a view of pmap), the load of each slot, and
    how many replicas of each expert each GPU [L, E, W] and node [L, E, N] holds."""

    def __init__(self, load: np.ndarray, pmap: np.ndarray, num_gpus: int, num_nodes: int):
        L, E = load.shape
        P = pmap.shape[1]
        self.W, self.S = num_gpus, P // num_gpus
        self.bins = pmap.reshape(L, self.W, self.S)  # a view: swaps write through to pmap
        per_replica = replica_weights(load, replica_counts_of(pmap, E))
        self.weights = np.take_along_axis(per_replica, pmap, axis=1).reshape(L, self.W, self.S)
        self.gpu_count = holders(pmap, E, num_gpus)
        self.node_count = holders(pmap, E, num_nodes) if num_nodes > 1 else None
        self.node_of_gpu = np.arange(num_gpus) // (num_gpus // num_nodes)
        self._buffers = (np.empty(0), np.empty(0))
        # No placement beats max(mean GPU load, heaviest replica): a layer this close is finished.
        self.bound = np.maximum(load.sum(axis=1) / num_gpus, per_replica.max(axis=1)) * (1.0 + _GAP)

    def unfinished(self, layers: np.ndarray) -> np.ndarray:
        busiest = self.weights[layers].sum(axis=2).max(axis=1)
        return layers[busiest > self.bound[layers]]

    def chunks(self, layers: np.ndarray) -> list[np.ndarray]:
        block = max(1, _SWAP_BLOCK_ELEMENTS // (self.S * self.W * self.S))
        return [layers[i:i + block] for i in range(0, layers.size, block)]

    def pair_round(self, layers: np.ndarray, offset: int = 0) -> np.ndarray:
        """Best swap inside each (i-th busiest, (i + offset)-th idlest) GPU pair; returns the
        layers that changed.

        Several swaps land at once, so a replica may cross nodes only towards a node that lacks
        its expert: then no node loses an expert it alone held."""
        compiled = kernel()
        if compiled is not None:  # the same round compiled (mending_compiled.py): the same swaps
            node_count = self.node_count if self.node_count is not None else np.zeros((0, 1, 1), dtype=np.int64)
            return layers[compiled.pair_round(self.bins, self.weights, self.gpu_count, node_count, self.node_of_gpu,
                                              layers, offset, _TOL)]
        A, W, S = layers.size, self.W, self.S
        loads = self.weights[layers].sum(axis=2)
        order = np.argsort(-loads, axis=1, kind="stable")
        K = W // 2
        heavy, light = order[:, :K], np.roll(order[:, ::-1][:, :K], -offset, axis=1)  # [A, K]
        lay2, lay3 = layers[:, None], layers[:, None, None]
        e_p, w_p = self.bins[lay2, heavy], self.weights[lay2, heavy]  # [A, K, S]
        e_q, w_q = self.bins[lay2, light], self.weights[lay2, light]
        load_p = np.take_along_axis(loads, heavy, axis=1)
        gap = load_p - np.take_along_axis(loads, light, axis=1)  # [A, K]
        a_bad = self.gpu_count[lay3, e_p, light[:, :, None]] > 0  # a already on q
        b_bad = self.gpu_count[lay3, e_q, heavy[:, :, None]] > 0  # b already on p
        if self.node_count is not None:
            n_p, n_q = self.node_of_gpu[heavy], self.node_of_gpu[light]
            cross = (n_p != n_q)[:, :, None]
            a_bad |= cross & (self.node_count[lay3, e_p, n_q[:, :, None]] > 0)
            b_bad |= cross & (self.node_count[lay3, e_q, n_p[:, :, None]] > 0)
        gain = self._gain((A, K, S, S), w_p[:, :, :, None], w_q[:, :, None, :], gap[:, :, None, None],
                          _forbid(a_bad)[:, :, :, None], _forbid(b_bad)[:, :, None, :]).reshape(A, K, S * S)
        best = np.argmax(gain, axis=2)
        best_gain = np.take_along_axis(gain, best[:, :, None], axis=2)[:, :, 0]
        changed = best_gain > _TOL * np.maximum(load_p, 1.0)
        rows, pair = np.nonzero(changed)
        a, b = np.divmod(best[rows, pair], S)
        self._swap(layers[rows], heavy[rows, pair], a, light[rows, pair], b)
        return layers[changed.any(axis=1)]

    def top_round(self, layers: np.ndarray) -> np.ndarray:
        """Best swap off the busiest GPU, first with the idlest GPUs only (cheap, and where the
        best swaps usually are), then, for layers where none of those helps, with every GPU;
        returns layers that changed."""
        W = self.W
        k = min(_TOP_PARTNERS, W)
        compiled = kernel()
        if compiled is not None:  # the same round compiled (mending_compiled.py): the same swaps
            node_count = self.node_count if self.node_count is not None else np.zeros((0, 1, 1), dtype=np.int64)
            how = compiled.top_round(self.bins, self.weights, self.gpu_count, node_count, self.node_of_gpu, layers,
                                     k, _TOL)
            # in numpy's order: those changed with the idlest, then the rest's (np.setdiff1d sorts them)
            return np.concatenate([layers[how == 1], np.sort(layers[how == 2])]) if k < W else layers[how == 2]
        loads = self.weights[layers].sum(axis=2)
        if k < W:
            idlest = np.argsort(loads, axis=1, kind="stable")[:, :k]
            changed = self._top_swap(layers, idlest)
            rest = np.setdiff1d(layers, changed, assume_unique=True)
        else:
            changed, rest = layers[:0], layers
        if rest.size:
            changed = np.concatenate([changed, self._top_swap(rest, np.broadcast_to(np.arange(W), (rest.size, W)))])
        return changed

    def _top_swap(self, layers: np.ndarray, partners: np.ndarray) -> np.ndarray:
        """Best swap of a replica on the busiest GPU with one on a GPU in `partners` [A, K]."""
        A, S = layers.size, self.S
        K = partners.shape[1]
        ar = np.arange(A)
        b_e = self.bins[layers]  # [A, W, S]
        b_w = self.weights[layers]
        loads = b_w.sum(axis=2)  # [A, W]
        h = np.argmax(loads, axis=1)
        top = loads[ar, h]
        e_h, w_h = b_e[ar, h], b_w[ar, h]  # [A, S]
        p_e, p_w = b_e[ar[:, None], partners], b_w[ar[:, None], partners]  # [A, K, S]
        lay2, lay3 = layers[:, None], layers[:, None, None]
        a_bad = self.gpu_count[lay3, e_h[:, :, None], partners[:, None, :]] > 0  # [A, S, K]: a on j
        b_bad = self.gpu_count[lay3, p_e, h[:, None, None]] > 0  # [A, K, S]: b already on h
        if self.node_count is not None:
            # One swap at a time here: a replica may leave a node it is alone on only for a node
            # that lacks its expert (then the count of nodes holding it cannot drop).
            n_h, n_j = self.node_of_gpu[h], self.node_of_gpu[partners]  # [A], [A, K]
            other = n_j != n_h[:, None]  # [A, K]
            a_alone = self.node_count[lay2, e_h, n_h[:, None]] == 1  # [A, S]
            a_there = self.node_count[lay3, e_h[:, :, None], n_j[:, None, :]] > 0  # [A, S, K]
            a_bad |= other[:, None, :] & a_alone[:, :, None] & a_there
            b_alone = self.node_count[lay3, p_e, n_j[:, :, None]] == 1  # [A, K, S]
            b_bad |= other[:, :, None] & b_alone & (self.node_count[lay3, p_e, n_h[:, None, None]] > 0)
        gap = top[:, None] - np.take_along_axis(loads, partners, axis=1)  # [A, K]
        gain = self._gain((A, S, K, S), w_h[:, :, None, None], p_w[:, None, :, :], gap[:, None, :, None],
                          _forbid(a_bad)[:, :, :, None], _forbid(b_bad)[:, None, :, :]).reshape(A, -1)
        best = np.argmax(gain, axis=1)
        changed = gain[ar, best] > _TOL * np.maximum(top, 1.0)
        a, rest = np.divmod(best[changed], K * S)
        k, b = np.divmod(rest, S)
        self._swap(layers[changed], h[changed], a, partners[changed, k], b)
        return layers[changed]

    def _gain(self, shape: tuple[int, ...], w_out: np.ndarray, w_in: np.ndarray, gap: np.ndarray,
              forbid_out: np.ndarray, forbid_in: np.ndarray) -> np.ndarray:
        """How much a swap lowers the busier GPU of a pair: with d = w_out - w_in moving off a GPU
        that is `gap` busier than the other, min(d, gap - d) (positive only for 0 < d < gap);
        -inf where forbidden. Computed into reused buffers: these arrays are the solver's bulk."""
        size = int(np.prod(shape))
        if self._buffers[0].size < size:
            self._buffers = (np.empty(size), np.empty(size))
        d = self._buffers[0][:size].reshape(shape)
        other = self._buffers[1][:size].reshape(shape)
        np.subtract(w_out, w_in, out=d)
        np.subtract(gap, d, out=other)
        np.minimum(d, other, out=d)
        d += forbid_out
        d += forbid_in
        return d

    def _swap(self, lay: np.ndarray, p: np.ndarray, a: np.ndarray, q: np.ndarray, b: np.ndarray) -> None:
        """Swap slot a of GPU p with slot b of GPU q, for each entry (bins (lay, p), (lay, q) all
        distinct)."""
        if lay.size == 0:
            return
        ea, eb = self.bins[lay, p, a].copy(), self.bins[lay, q, b].copy()
        wa, wb = self.weights[lay, p, a].copy(), self.weights[lay, q, b].copy()
        self.bins[lay, p, a], self.bins[lay, q, b] = eb, ea
        self.weights[lay, p, a], self.weights[lay, q, b] = wb, wa
        np.add.at(self.gpu_count, (lay, ea, p), -1)
        np.add.at(self.gpu_count, (lay, ea, q), 1)
        np.add.at(self.gpu_count, (lay, eb, q), -1)
        np.add.at(self.gpu_count, (lay, eb, p), 1)
        if self.node_count is not None:
            np_, nq = self.node_of_gpu[p], self.node_of_gpu[q]
            np.add.at(self.node_count, (lay, ea, np_), -1)
            np.add.at(self.node_count, (lay, ea, nq), 1)
            np.add.at(self.node_count, (lay, eb, nq), -1)
            np.add.at(self.node_count, (lay, eb, np_), 1)


def _forbid(bad: np.ndarray) -> np.ndarray:
    """Boolean mask -> 0.0 where allowed, -inf where forbidden (added to a gain)."""
    return np.where(bad, -np.inf, 0.0)


def pack(load: np.ndarray, counts: np.ndarray, num_gpus: int, num_nodes: int = 1,
         max_rounds: int = 400) -> np.ndarray:
    """[L, E] load, [L, E] replica counts -> [L, P] balanced placement (LPT, then swaps)."""
    pmap = lpt_pack(load, counts, num_gpus, num_nodes)
    return refine_by_swaps(load, pmap, num_gpus, num_nodes, max_rounds)
