"""Affinity-aware placement: put experts that follow each other between layers on the same GPU.

ExFlow (IPDPS'24, [exflow]) observed that a token's expert at layer l+1 depends strongly on its expert at
layer l, and placed experts so that such pairs share a GPU, but balanced expert counts per GPU, not
tokens. Here the same goal is pursued under a floor on token balancedness.

The objective counts a token's consecutive-layer pairs (every one of its k experts at layer l with
every one of its k experts at l + 1) that stay on one GPU (and, with several nodes, on one node)
when the token stays on its expert's GPU between layers: the execution where this pays off is
ExFlow's one all-to-all per layer. With the usual dispatch-and-return all-to-all each layer starts
from the token's own rank again, and only the dispatch shares (placement_math.dispatch_cross_shares)
matter.

Method (affinity_placement): start from the balanced plan; group layer 0's experts by where their
pairs go (one group per GPU) and place each next layer after the one before (a chain); then sweep,
re-placing every other layer at once (even layers, then odd: each sees fixed neighbours), replicas
heaviest first on the GPU that keeps most of their pairs among GPUs under the load cap implied by
the floor, and improve each with swaps between GPU pairs. A layer keeps a new placement only when
it scores better and still meets the floor.

Little data overfits (the issue cites a 577-token Mixtral trace whose placements, fitted on one
half, did worse on the other than ExFlow's published placement): counts from all k x k pairs per
token carry more signal than top-1 pairs, and `discount` subtracts a constant from every count
(absolute discounting), dropping pairs seen only once or twice before they steer the placement.
The benchmark scores placements on held-out tokens.

Sizes: T tokens, L layers, k experts per token, E experts, P slots, W GPUs, N nodes.
"""

from __future__ import annotations

import numpy as np

from .placement_math import holders, pairs_from_groups, pairs_reaching_groups, placement_balancedness, replica_counts_of
from .packing import refine_by_swaps, replica_weights, replicas_in_order


def transitions_from_trace(trace: np.ndarray, num_experts: int, discount: float = 0.0) -> np.ndarray:
    """[T, L, k] expert ids -> [L-1, E, E] float64 counts of (expert at l, expert at l+1) pairs,
    all k x k pairs of each token; `discount` is subtracted from every nonzero count (floor 0)."""
    trace = np.asarray(trace, dtype=np.int64)
    T, L, k = trace.shape
    E = num_experts
    out = np.zeros((max(L - 1, 0), E, E))
    for layer in range(L - 1):
        src = np.repeat(trace[:, layer, :], k, axis=1)  # [T, k*k]
        dst = np.tile(trace[:, layer + 1, :], (1, k))
        out[layer] = np.bincount((src * E + dst).ravel(), minlength=E * E).reshape(E, E)
    if discount > 0:
        out = np.maximum(out - discount, 0.0)
    return out


def load_from_trace(trace: np.ndarray, num_experts: int) -> np.ndarray:
    """[T, L, k] expert ids -> [L, E] pairs routed to each expert."""
    trace = np.asarray(trace, dtype=np.int64)
    L = trace.shape[1]
    flat = (np.arange(L)[None, :, None] * num_experts + trace).ravel()
    return np.bincount(flat, minlength=L * num_experts).reshape(L, num_experts).astype(np.float64)


def layer_scores(transitions: np.ndarray, pmap: np.ndarray, layers: np.ndarray, num_experts: int,
                 num_gpus: int, num_nodes: int = 1, neighbours: str = "both") -> np.ndarray:
    """-> [A, E, W] pairs a replica of expert e keeps on GPU g (plus on g's node when N > 1),
    for each of `layers`, given the placement of the neighbouring layers in pmap.

    In: pairs (i at l-1, e) whose token sits on g (the share of i's replicas on g) stay when g
    holds e. Out: the replica carries 1 / (replicas of e) of e's tokens; a pair (e, j at l+1)
    stays when g holds j. neighbours="previous" counts the in-pairs only."""
    L = pmap.shape[0]
    E, W, N = num_experts, num_gpus, num_nodes
    score = np.zeros((layers.size, E, W))
    groups = [(W, np.arange(W))] + ([(N, np.arange(W) // (W // N))] if N > 1 else [])
    has_prev = layers > 0
    has_next = (layers < L - 1) & (neighbours == "both")
    prev, nxt = layers[has_prev] - 1, layers[has_next] + 1
    for size, column in groups:
        part = np.zeros((layers.size, E, size))
        if prev.size:
            part[has_prev] += pairs_from_groups(transitions[prev], pmap[prev], size)
        if nxt.size:
            counts = np.maximum(replica_counts_of(pmap[layers[has_next]], E), 1)
            part[has_next] += pairs_reaching_groups(transitions[layers[has_next]], pmap[nxt], size) / counts[:, :, None]
        score += part[:, :, column]
    return score


def placement_score(score: np.ndarray, pmap_rows: np.ndarray, num_gpus: int) -> np.ndarray:
    """[A, E, W] scores, [A, P] placements -> [A] summed score of every slot."""
    A, P = pmap_rows.shape
    gpu = np.arange(P) // (P // num_gpus)
    return score[np.arange(A)[:, None], pmap_rows, gpu[None, :]].sum(axis=1)


def assign_by_score(load: np.ndarray, counts: np.ndarray, score: np.ndarray, num_gpus: int,
                    cap: np.ndarray) -> np.ndarray:
    """[A, E] load, [A, E] counts, [A, E, W] score, [A] per-GPU load cap -> [A, P] placement.

    Replicas, heaviest first, go to the GPU with the best score among those with a free slot, not
    holding the expert, and staying under the cap; without such a GPU, to the lightest with a free
    slot (not holding the expert when possible)."""
    A, E = load.shape
    W = num_gpus
    P = int(counts[0].sum())
    S = P // W
    rows = np.arange(A)
    items, weights = replicas_in_order(load, counts)
    items_t, weights_t = items.T.copy(), weights.T.copy()
    loads = np.zeros((A, W))
    fill = np.zeros((A, W), dtype=np.int64)
    on_gpu = np.zeros((A, E, W), dtype=bool)
    gpu_of_item = np.empty((P, A), dtype=np.int64)
    spread = np.maximum(score.max(axis=(1, 2)), 1e-12)[:, None]
    total = load.sum(axis=1)[:, None] + 1.0
    lightest = weights_t[-1][:, None]
    for k in range(P):
        expert, weight = items_t[k], weights_t[k]
        room = fill < S
        fresh = room & ~on_gpu[rows, expert]
        # leave room under the cap for the GPU's remaining slots, each at least the lightest replica
        fits = fresh & (loads + weight[:, None] + (S - 1 - fill) * lightest <= cap[:, None])
        # score first; among equal scores the lighter GPU (the load term stays below any real gap)
        best = np.where(fits, score[rows, expert] / spread - 1e-6 * loads / total, -np.inf)
        fallback = np.where(fresh, -loads, -np.inf)
        fallback = np.where(fresh.any(axis=1)[:, None], fallback, np.where(room, -loads, -np.inf))
        use_best = fits.any(axis=1)
        gpu = np.where(use_best, np.argmax(best, axis=1), np.argmax(fallback, axis=1))
        gpu_of_item[k] = gpu
        loads[rows, gpu] += weight
        fill[rows, gpu] += 1
        on_gpu[rows, expert, gpu] = True
    order = np.argsort(gpu_of_item.T, axis=1, kind="stable")
    return np.take_along_axis(items, order, axis=1)


def round_robin(num_gpus: int) -> list[np.ndarray]:
    """Rounds of disjoint GPU pairs [W // 2, 2] in which every pair meets once (circle method;
    with an odd W one GPU sits out each round)."""
    players = list(range(num_gpus)) + ([-1] if num_gpus % 2 else [])
    n = len(players)
    rounds = []
    for _ in range(n - 1):
        pairs = [(players[i], players[n - 1 - i]) for i in range(n // 2)]
        rounds.append(np.array([p for p in pairs if -1 not in p], dtype=np.int64).reshape(-1, 2))
        players = [players[0], players[-1]] + players[1:-1]
    return rounds


def improve_by_swaps(load: np.ndarray, rows: np.ndarray, score: np.ndarray, num_gpus: int,
                     cap: np.ndarray, tournaments: int = 4) -> np.ndarray:
    """[A, E] load, [A, P] placements, [A, E, W] scores, [A] per-GPU load cap -> [A, P] placements
    with a higher summed score, no GPU above the cap that was not already, replica counts unchanged.

    In each round GPUs meet in disjoint pairs (a round-robin tournament, so every pair meets once
    per tournament) and each pair makes the swap of one replica each that adds the most score
    while both stay under the cap and neither ends up holding an expert twice."""
    rows = rows.copy()
    A, P = rows.shape
    E = load.shape[1]
    W = num_gpus
    S = P // W
    ar = np.arange(A)[:, None, None]
    weights = np.take_along_axis(replica_weights(load, replica_counts_of(rows, E)), rows, axis=1)
    bins = rows.reshape(A, W, S)  # view
    bin_w = weights.reshape(A, W, S)
    held = holders(rows, E, W)  # [A, E, W]
    schedule = round_robin(W)
    for _ in range(tournaments):
        swapped = 0
        for pairs in schedule:
            if pairs.size == 0:
                continue
            p, q = pairs[:, 0], pairs[:, 1]  # [K]
            e_p, e_q = bins[:, p], bins[:, q]  # [A, K, S]
            w_p, w_q = bin_w[:, p], bin_w[:, q]
            load_p, load_q = w_p.sum(axis=2), w_q.sum(axis=2)  # [A, K]
            # score of moving a (on p) to q and b (on q) to p, against staying
            gain_a = score[ar, e_p, q[None, :, None]] - score[ar, e_p, p[None, :, None]]  # [A, K, S]
            gain_b = score[ar, e_q, p[None, :, None]] - score[ar, e_q, q[None, :, None]]
            gain = gain_a[:, :, :, None] + gain_b[:, :, None, :]  # [A, K, S(a), S(b)]
            d = w_p[:, :, :, None] - w_q[:, :, None, :]
            c = cap[:, None, None, None]
            ok = (load_p[:, :, None, None] - d <= c) & (load_q[:, :, None, None] + d <= c)
            ok &= (held[ar, e_p, q[None, :, None]] == 0)[:, :, :, None]
            ok &= (held[ar, e_q, p[None, :, None]] == 0)[:, :, None, :]
            ok &= (e_p[:, :, :, None] != e_q[:, :, None, :])
            gain = np.where(ok, gain, -np.inf).reshape(A, p.size, S * S)
            best = np.argmax(gain, axis=2)
            best_gain = np.take_along_axis(gain, best[:, :, None], axis=2)[:, :, 0]
            scale = np.abs(score).max(axis=(1, 2))[:, None] + 1e-300
            lay, k = np.nonzero(best_gain > 1e-9 * scale)
            if lay.size == 0:
                continue
            a, b = np.divmod(best[lay, k], S)
            gp, gq = p[k], q[k]
            ea, eb = bins[lay, gp, a].copy(), bins[lay, gq, b].copy()
            wa, wb = bin_w[lay, gp, a].copy(), bin_w[lay, gq, b].copy()
            bins[lay, gp, a], bins[lay, gq, b] = eb, ea
            bin_w[lay, gp, a], bin_w[lay, gq, b] = wb, wa
            np.add.at(held, (lay, ea, gp), -1)
            np.add.at(held, (lay, ea, gq), 1)
            np.add.at(held, (lay, eb, gq), -1)
            np.add.at(held, (lay, eb, gp), 1)
            swapped += lay.size
        if swapped == 0:
            break
    return rows


def affinity_placement(load: np.ndarray, transitions: np.ndarray, start: np.ndarray, num_gpus: int,
                       num_nodes: int = 1, floor: float = 0.95, sweeps: int = 8,
                       seed: int = 0) -> np.ndarray:
    """[L, E] load, [L-1, E, E] transitions, [L, P] balanced start -> [L, P] placement that keeps
    more consecutive-layer pairs on a GPU, every layer at balancedness >= min(floor, start's).

    1. Chain: layer 0's experts are grouped by where their pairs go (spherical k-means on the rows
       of transitions[0], one group per GPU), then each next layer is placed by its pairs from the
       layer before. Grouping the first layer is what lets a chain of followers gather on one GPU;
       from a placement balanced at random, followers stay spread.
    2. Sweeps: even layers, then odd, re-placed given both neighbours, kept only where better.
    """
    load = np.asarray(load, dtype=np.float64)
    transitions = np.asarray(transitions, dtype=np.float64)
    L, E = load.shape
    W = num_gpus
    if L < 2 or W < 2 or transitions.sum() <= 0:
        return start.copy()
    counts = replica_counts_of(start, E)
    floor_per_layer = np.minimum(floor, placement_balancedness(load, start, W))
    mean = load.sum(axis=1) / W
    # Assign under a cap a little tighter than the floor: packing by score leaves some slack.
    cap = mean / np.minimum(floor_per_layer + 0.5 * (1.0 - floor_per_layer), 1.0)
    target_max = mean / floor_per_layer

    def place(layers: np.ndarray, score: np.ndarray) -> np.ndarray:
        proposal = assign_by_score(load[layers], counts[layers], score, W, cap[layers])
        low = placement_balancedness(load[layers], proposal, W) < floor_per_layer[layers]
        if low.any():
            proposal = refine_by_swaps(load[layers], proposal, W, num_nodes, layers=np.flatnonzero(low),
                                       target_max=target_max[layers], pairs=False)
        return proposal

    def meets_floor(layers: np.ndarray, proposal: np.ndarray) -> np.ndarray:
        return placement_balancedness(load[layers], proposal, W) >= floor_per_layer[layers]

    pmap = start.copy()
    first = np.array([0])
    proposal = place(first, group_similarity(transitions[0], W, seed)[None])
    if meets_floor(first, proposal)[0]:
        pmap[0] = proposal[0]
    for layer in range(1, L):
        this = np.array([layer])
        score = layer_scores(transitions, pmap, this, E, W, num_nodes, neighbours="previous")
        proposal = place(this, score)
        if meets_floor(this, proposal)[0]:
            pmap[layer] = proposal[0]
    parity = [np.arange(0, L, 2), np.arange(1, L, 2)]
    for _ in range(sweeps):
        changed = False
        for layers in parity:
            score = layer_scores(transitions, pmap, layers, E, W, num_nodes)
            proposal = place(layers, score)
            better = placement_score(score, proposal, W) > placement_score(score, pmap[layers], W) * (1 + 1e-9)
            better &= meets_floor(layers, proposal)
            chosen = np.where(better[:, None], proposal, pmap[layers])
            improved = improve_by_swaps(load[layers], chosen, score, W, target_max[layers])
            gained = placement_score(score, improved, W) > placement_score(score, pmap[layers], W) * (1 + 1e-9)
            if gained.any():
                pmap[layers[gained]] = improved[gained]
                changed = True
        if not changed:
            break
    return pmap


def group_similarity(rows: np.ndarray, num_groups: int, seed: int = 0, iterations: int = 25) -> np.ndarray:
    """[n, d] profiles -> [n, num_groups] cosine similarity of each to its group's centre, after
    spherical k-means (k-means++ seeding, fixed seed: the same input gives the same plan)."""
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    x = np.divide(rows, norms, out=np.zeros_like(rows, dtype=np.float64), where=norms > 0)
    n = x.shape[0]
    rng = np.random.default_rng(seed)
    centres = np.empty((num_groups, x.shape[1]))
    centres[0] = x[rng.integers(n)]
    closest = 1.0 - x @ centres[0]
    for c in range(1, num_groups):
        weight = np.maximum(closest, 0.0)
        pick = rng.choice(n, p=weight / weight.sum()) if weight.sum() > 0 else rng.integers(n)
        centres[c] = x[pick]
        closest = np.minimum(closest, 1.0 - x @ centres[c])
    for _ in range(iterations):
        label = np.argmax(_cosines(x, centres), axis=1)
        sums = np.zeros_like(centres)
        np.add.at(sums, label, x)
        size = np.linalg.norm(sums, axis=1, keepdims=True)
        centres = np.where(size > 0, sums / np.maximum(size, 1e-300), centres)
    return _cosines(x, centres)


def _cosines(x: np.ndarray, centres: np.ndarray) -> np.ndarray:
    # einsum without BLAS: BLAS threads crawl on shared CPUs (see metrics.pairs_reaching_groups)
    return np.einsum("nd,kd->nk", x, centres)
