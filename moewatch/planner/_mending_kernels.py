"""The numba functions behind mending_compiled.py: imported only where numba is installed, so that
the rest of the planner never needs it. Module-level, so numba can cache what it compiles.

Each is its numpy twin in incremental.py step for step; read the reasons there.
"""

import numba
import numpy as np

njit = numba.njit(cache=True, nogil=True)


@njit
def numpy_sum(values):
    # numpy's add-reduce of a contiguous row: sequential under 8 values, else eight running sums
    # per block of up to 128 values, halves summed apart (pairwise) above that.
    n = values.shape[0]
    if n < 8:
        total = 0.0
        for i in range(n):
            total += values[i]
        return total
    if n <= 128:
        r = np.empty(8)
        for j in range(8):
            r[j] = values[j]
        i = 8
        while i < n - n % 8:
            for j in range(8):
                r[j] += values[i + j]
            i += 8
        total = (r[0] + r[1]) + (r[2] + r[3]) + ((r[4] + r[5]) + (r[6] + r[7]))
        while i < n:
            total += values[i]
            i += 1
        return total
    half = n // 2
    half -= half % 8
    return numpy_sum(values[:half]) + numpy_sum(values[half:])

@njit
def best_swaps(bins, w, gpu, heavy, partners, cur, target, node_of, min_gain, out_a, out_q, out_b, out_enough):
    # incremental._best_swaps for one layer: [W, S] experts and loads, [W] GPU loads, [M] heavy
    # GPUs, [M, K] partners, [W, S] placement in force -> the outs, each [M]. Candidates are
    # visited partner by partner; a tie goes to the lower index in numpy's (slot, partner, slot)
    # order, which is what numpy's first maximum picks.
    W, S = bins.shape
    M, K = partners.shape
    q_on_h = np.empty(S, dtype=np.bool_)
    for m in range(M):
        p = heavy[m]
        load_h = gpu[p]
        inv = 1.0 / max(load_h, 1e-300)
        need = (load_h - target) * inv
        best_score = -np.inf
        best = 0
        for k in range(K if need > 0.0 else 0):  # not over the target: no swap is of use
            q = partners[m, k]
            gap = (load_h - gpu[q]) * inv
            # No swap gains more than half the gap (rounding aside): a pair that cannot gain, or that
            # cannot gain enough where only enough counts (m > 0), has no candidate.
            reach = gap * 0.5 * (1.0 + 1e-12)
            if reach <= min_gain or (m > 0 and reach < need):
                continue
            across = 0.5 if node_of[q] != node_of[p] else 0.0
            for b in range(S):
                found = False
                for t in range(S):
                    if bins[p, t] == bins[q, b]:
                        found = True
                        break
                q_on_h[b] = found
            for a in range(S):
                e_h = bins[p, a]
                clash = False
                for t in range(S):
                    if e_h == bins[q, t]:
                        clash = True
                        break
                if clash:
                    continue
                c_h = cur[p, a]
                w_h = w[p, a] * inv
                kept_h = 9.0 if e_h != c_h else 8.0
                for b in range(S):
                    if q_on_h[b]:
                        continue
                    d = w_h - w[q, b] * inv
                    gain = min(d, gap - d)
                    if gain <= min_gain:
                        continue
                    enough = gain >= need
                    if m > 0 and not enough:
                        continue
                    if enough:
                        e_q = bins[q, b]
                        c_q = cur[q, b]
                        score = kept_h + ((1.0 if e_q != c_q else 0.0) - across)
                        score -= 1.0 if e_q != c_h else 0.0
                        score -= 1.0 if e_h != c_q else 0.0
                        score += 1.0 - gain
                    else:
                        score = 0.0 + gain
                    index = (a * K + k) * S + b
                    if score > best_score or (score == best_score and index < best):
                        best_score = score
                        best = index
        if np.isfinite(best_score):
            a = best // (K * S)
            rest = best % (K * S)
            out_a[m] = a
            out_q[m] = partners[m, rest // S]
            out_b[m] = rest % S
            out_enough[m] = best_score > 2.0
        else:
            out_a[m] = -1
            out_q[m] = -1
            out_b[m] = -1
            out_enough[m] = False


@njit
def sort_busiest_first(order, gpu):
    # numpy's stable argsort of -gpu, in place: heaviest first, ties by GPU index. Insertion sort,
    # started from the last round's order, which a round's few swaps hardly change.
    for i in range(1, order.shape[0]):
        g = order[i]
        j = i - 1
        while j >= 0 and (gpu[order[j]] < gpu[g] or (gpu[order[j]] == gpu[g] and order[j] > g)):
            order[j + 1] = order[j]
            j -= 1
        order[j + 1] = g


@njit
def swap_down(row, weights, current, target_max, budget, node_of, num_gpus, heavy_per_round, idlest_partners,
              busiest_partners, stall_rounds, progress, min_gain):
    # incremental._swap_down, one layer at a time (the layers never meet): [L, P] row and
    # weights swapped in place, [L, P] placement in force, [L] target and budget -> [L] swaps.
    L, P = row.shape
    W = num_gpus
    S = P // W
    M = max(1, min(heavy_per_round, W // 4))
    K = max(1, min(idlest_partners, (W - M) // M))
    swaps = np.zeros(L, dtype=np.int64)
    gpu = np.empty(W)
    a = np.empty(M, dtype=np.int64)
    q = np.empty(M, dtype=np.int64)
    b = np.empty(M, dtype=np.int64)
    enough = np.empty(M, dtype=np.bool_)
    one_a = np.empty(1, dtype=np.int64)
    one_q = np.empty(1, dtype=np.int64)
    one_b = np.empty(1, dtype=np.int64)
    one_enough = np.empty(1, dtype=np.bool_)
    idle = np.empty((M, K), dtype=np.int64)
    order = np.empty(W, dtype=np.int64)
    heavy = np.empty(M, dtype=np.int64)
    idlest = np.empty((1, W), dtype=np.int64)
    for layer in range(L):
        if budget[layer] <= 0:
            continue
        bins = row[layer].reshape(W, S)
        w = weights[layer].reshape(W, S)
        cur = current[layer].reshape(W, S)
        target = target_max[layer]
        checkpoint = np.inf
        rounds = 0
        for g in range(W):
            order[g] = g
        while True:
            for g in range(W):
                gpu[g] = numpy_sum(w[g])
            sort_busiest_first(order, gpu)
            top = gpu[order[0]]
            over = not (top <= target * (1.0 + 1e-12))
            if rounds % stall_rounds == 0:
                over = over and top < checkpoint * (1.0 - progress)
                checkpoint = top
            rounds += 1
            if not over:
                break
            heavy[:] = order[:M]
            for m in range(M):
                for k in range(K):
                    idle[m, k] = order[W - 1 - (k * M + m)]
            best_swaps(bins, w, gpu, heavy, idle, cur, target, node_of, min_gain, a, q, b, enough)
            for wider in (busiest_partners, W):
                short = (not enough[0]) if wider < W else a[0] < 0
                if not short:
                    continue
                n = min(wider, W)
                for k in range(n):
                    idlest[0, k] = order[W - 1 - k]
                best_swaps(bins, w, gpu, heavy[:1], idlest[:, :n], cur, target, node_of, min_gain,
                           one_a, one_q, one_b, one_enough)
                if one_a[0] >= 0:
                    a[:] = -1
                    q[:] = -1
                    b[:] = -1
                    enough[:] = False
                    a[0], q[0], b[0], enough[0] = one_a[0], one_q[0], one_b[0], one_enough[0]
            made = 0
            for m in range(M):
                if m >= budget[layer] - swaps[layer] or a[m] < 0:
                    continue
                src = heavy[m] * S + a[m]
                dst = q[m] * S + b[m]
                e = row[layer, src]
                row[layer, src] = row[layer, dst]
                row[layer, dst] = e
                x = weights[layer, src]
                weights[layer, src] = weights[layer, dst]
                weights[layer, dst] = x
                made += 1
            if made == 0:
                break
            swaps[layer] += made
            if swaps[layer] >= budget[layer]:
                break
    return swaps

@njit
def mend_counts(load, row, num_gpus, heaviest_allowed, budget):
    # incremental._mend_counts, one layer at a time: [L, E] load, [L, P] row rewritten in place,
    # [L] limit and budget -> [L] slots rewritten.
    L, E = load.shape
    P = row.shape[1]
    W = num_gpus
    S = P // W
    changes = np.zeros(L, dtype=np.int64)
    counts = np.empty(E, dtype=np.int64)
    per = np.empty(E)
    after = np.empty(E)
    free_of = np.empty(E, dtype=np.bool_)
    taker_on_gpu = np.empty(W, dtype=np.bool_)
    gpu = np.empty(W)
    slot_load = np.empty(S)
    for layer in range(L):
        if budget[layer] <= 0:
            continue
        counts[:] = 0
        for s in range(P):
            counts[row[layer, s]] += 1
        limit = heaviest_allowed[layer]
        while True:
            for e in range(E):
                per[e] = load[layer, e] / max(counts[e], 1)
            taker = 0
            for e in range(1, E):
                if per[e] > per[taker]:
                    taker = e
            for g in range(W):
                on = False
                for t in range(S):
                    if row[layer, g * S + t] == taker:
                        on = True
                taker_on_gpu[g] = on
            free_of[:] = False
            for s in range(P):
                if not taker_on_gpu[s // S]:
                    free_of[row[layer, s]] = True
            for e in range(E):
                after[e] = load[layer, e] / max(counts[e] - 1, 1) if counts[e] >= 2 else np.inf
            after[taker] = np.inf
            giver = 0
            best = np.inf if not free_of[0] else after[0]
            for e in range(1, E):
                value = after[e] if free_of[e] else np.inf
                if value < best:
                    best = value
                    giver = e
            if not free_of[giver] or not np.isfinite(after[giver]):
                giver = 0
                for e in range(1, E):
                    if after[e] < after[giver]:
                        giver = e
            if not (per[taker] > limit and after[giver] <= limit):
                break
            for g in range(W):
                for t in range(S):
                    slot_load[t] = per[row[layer, g * S + t]]
                gpu[g] = numpy_sum(slot_load)
            # the giver's replica on its least-loaded GPU, one without the taker when it has one
            slot = 0
            best = np.inf
            for s in range(P):
                if row[layer, s] != giver:
                    continue
                key = gpu[s // S] + (0.0 if not taker_on_gpu[s // S] else 1e300)
                if key < best:
                    best = key
                    slot = s
            row[layer, slot] = taker
            counts[taker] += 1
            counts[giver] -= 1
            changes[layer] += 1
            if changes[layer] >= budget[layer]:
                break
    return changes



@njit
def lpt_assign(scaled, expert_rows, num_gpus, num_nodes, slots_per_gpu, num_expert_rows):
    # packing.lpt_pack's loop, one layer at a time: replica k of each layer (heaviest first) to the
    # GPU with the least key + penalty (the first on ties); scaled, expert_rows: [P, L] -> [P, L] GPUs
    P, L = scaled.shape
    W = num_gpus
    G = W // num_nodes
    key = np.zeros((L, W))
    fill = np.zeros((L, W), dtype=np.int64)
    penalty = np.zeros((num_expert_rows, W))
    flag = 3.0 if num_nodes > 1 else 2.0
    out = np.empty((P, L), dtype=np.int64)
    for k in range(P):
        for layer in range(L):
            le = expert_rows[k, layer]
            best = 0
            best_value = penalty[le, 0] + key[layer, 0]
            for g in range(1, W):
                value = penalty[le, g] + key[layer, g]
                if value < best_value:
                    best_value = value
                    best = g
            out[k, layer] = best
            filled = fill[layer, best] + 1
            fill[layer, best] = filled
            key[layer, best] += scaled[k, layer] + (4.0 if filled == slots_per_gpu else 0.0)
            if num_nodes > 1:
                first = (best // G) * G
                for g in range(first, first + G):
                    if penalty[le, g] < 1.0:
                        penalty[le, g] = 1.0
            penalty[le, best] = flag
    return out


@njit
def _gpu_loads(weights, layer, loads, row):
    # loads[g] = GPU g's load in numpy's order of summing (weights: [L, W, S]; row: [S] scratch)
    for g in range(weights.shape[1]):
        for s in range(weights.shape[2]):
            row[s] = weights[layer, g, s]
        loads[g] = numpy_sum(row)


@njit
def _swap_slots(bins, weights, gpu_count, node_count, node_of_gpu, layer, p, a, q, b):
    # packing._SwapState._swap for one entry: slot a of GPU p with slot b of GPU q, counts kept
    ea, eb = bins[layer, p, a], bins[layer, q, b]
    wa, wb = weights[layer, p, a], weights[layer, q, b]
    bins[layer, p, a], bins[layer, q, b] = eb, ea
    weights[layer, p, a], weights[layer, q, b] = wb, wa
    gpu_count[layer, ea, p] -= 1
    gpu_count[layer, ea, q] += 1
    gpu_count[layer, eb, q] -= 1
    gpu_count[layer, eb, p] += 1
    if node_count.shape[0] > 0:
        n_p, n_q = node_of_gpu[p], node_of_gpu[q]
        node_count[layer, ea, n_p] -= 1
        node_count[layer, ea, n_q] += 1
        node_count[layer, eb, n_q] -= 1
        node_count[layer, eb, n_p] += 1


@njit
def pair_round(bins, weights, gpu_count, node_count, node_of_gpu, layers, offset, tol):
    # packing._SwapState.pair_round, layer by layer: the best swap inside each (i-th busiest,
    # (i + offset)-th idlest) GPU pair, every pair judged on the state before the round; node_count
    # has no rows when there is one node. bins, weights: [L, W, S] -> [A] whether each layer changed
    A = layers.shape[0]
    W, S = bins.shape[1], bins.shape[2]
    K = W // 2
    nodes = node_count.shape[0] > 0
    changed = np.zeros(A, dtype=np.bool_)
    loads = np.empty(W)
    row = np.empty(S)
    heavy = np.empty(K, dtype=np.int64)
    light = np.empty(K, dtype=np.int64)
    swap_a = np.empty(K, dtype=np.int64)
    swap_b = np.empty(K, dtype=np.int64)
    take = np.zeros(K, dtype=np.bool_)
    forbid_a = np.empty(S)
    forbid_b = np.empty(S)
    for i in range(A):
        layer = layers[i]
        _gpu_loads(weights, layer, loads, row)
        order = np.argsort(-loads, kind="mergesort")
        for j in range(K):
            heavy[j] = order[j]
            light[j] = order[W - 1 - (j + offset) % K]
        for j in range(K):
            p, q = heavy[j], light[j]
            load_p = loads[p]
            gap = load_p - loads[q]
            cross = nodes and node_of_gpu[p] != node_of_gpu[q]
            for s in range(S):
                bad = gpu_count[layer, bins[layer, p, s], q] > 0
                if cross and node_count[layer, bins[layer, p, s], node_of_gpu[q]] > 0:
                    bad = True
                forbid_a[s] = -np.inf if bad else 0.0
                bad = gpu_count[layer, bins[layer, q, s], p] > 0
                if cross and node_count[layer, bins[layer, q, s], node_of_gpu[p]] > 0:
                    bad = True
                forbid_b[s] = -np.inf if bad else 0.0
            best = -np.inf
            best_a = 0
            best_b = 0
            first = True
            for a in range(S):
                for b in range(S):
                    d = weights[layer, p, a] - weights[layer, q, b]
                    other = gap - d
                    gain = d if d <= other else other
                    gain += forbid_a[a]
                    gain += forbid_b[b]
                    if first or gain > best:
                        best, best_a, best_b, first = gain, a, b, False
            swap_a[j], swap_b[j] = best_a, best_b
            take[j] = best > tol * max(load_p, 1.0)
        for j in range(K):
            if not take[j]:
                continue
            changed[i] = True
            _swap_slots(bins, weights, gpu_count, node_count, node_of_gpu, layer, heavy[j], swap_a[j], light[j],
                        swap_b[j])
    return changed


@njit
def _top_swap_layer(bins, weights, gpu_count, node_count, node_of_gpu, layer, partners, loads, tol):
    # packing._SwapState._top_swap for one layer: the best swap of a replica on the busiest GPU with
    # one on a GPU in `partners` [K] (s, then partner, then t: the first maximum); True when made
    W, S = bins.shape[1], bins.shape[2]
    K = partners.shape[0]
    nodes = node_count.shape[0] > 0
    h = 0
    for g in range(1, W):
        if loads[g] > loads[h]:
            h = g
    top = loads[h]
    n_h = node_of_gpu[h]
    forbid_a = np.empty((S, K))
    forbid_b = np.empty((K, S))
    for k in range(K):
        j = partners[k]
        other = nodes and node_of_gpu[j] != n_h
        for s in range(S):
            e = bins[layer, h, s]
            bad = gpu_count[layer, e, j] > 0
            if other and node_count[layer, e, n_h] == 1 and node_count[layer, e, node_of_gpu[j]] > 0:
                bad = True
            forbid_a[s, k] = -np.inf if bad else 0.0
            e = bins[layer, j, s]
            bad = gpu_count[layer, e, h] > 0
            if other and node_count[layer, e, node_of_gpu[j]] == 1 and node_count[layer, e, n_h] > 0:
                bad = True
            forbid_b[k, s] = -np.inf if bad else 0.0
    best = -np.inf
    best_s, best_k, best_t = 0, 0, 0
    first = True
    for s in range(S):
        for k in range(K):
            j = partners[k]
            gap = top - loads[j]
            for t in range(S):
                d = weights[layer, h, s] - weights[layer, j, t]
                other_side = gap - d
                gain = d if d <= other_side else other_side
                gain += forbid_a[s, k]
                gain += forbid_b[k, t]
                if first or gain > best:
                    best, best_s, best_k, best_t, first = gain, s, k, t, False
    if not best > tol * max(top, 1.0):
        return False
    _swap_slots(bins, weights, gpu_count, node_count, node_of_gpu, layer, h, best_s, partners[best_k], best_t)
    return True


@njit
def top_round(bins, weights, gpu_count, node_count, node_of_gpu, layers, idlest, tol):
    # packing._SwapState.top_round, layer by layer: the best swap off the busiest GPU with one of the
    # `idlest` GPUs (none when idlest >= W), else with any GPU -> [A] 1 (changed with the idlest),
    # 2 (changed with any GPU) or 0
    A = layers.shape[0]
    W, S = bins.shape[1], bins.shape[2]
    out = np.zeros(A, dtype=np.int64)
    loads = np.empty(W)
    row = np.empty(S)
    everyone = np.arange(W)
    for i in range(A):
        layer = layers[i]
        _gpu_loads(weights, layer, loads, row)
        if idlest < W:
            partners = np.argsort(loads, kind="mergesort")[:idlest]
            if _top_swap_layer(bins, weights, gpu_count, node_count, node_of_gpu, layer, partners, loads, tol):
                out[i] = 1
                continue
        if _top_swap_layer(bins, weights, gpu_count, node_count, node_of_gpu, layer, everyone, loads, tol):
            out[i] = 2
    return out
