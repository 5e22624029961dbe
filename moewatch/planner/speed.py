"""Placement for ranks of different speeds: balance each rank's predicted time, load / speed.

A layer's step waits for its slowest rank, and a rank's time is its load over its speed (pairs per
second; any scale, normalised to mean 1). Per layer (`balance_time`):
1. Starts: the speed-oblivious plan, and `time_lpt_pack` seeds: replicas, heaviest first, to the
   GPU whose finish time (load + w) / speed is smallest among those with a free slot that do not
   hold the expert (Aurora's "heaviest to fastest" for heterogeneous GPUs), with P, (P + E) / 2
   and E replicas, the rest of the slots padding; small layers add a seed for every replica-count
   vector (`small_count_vectors`). `only_padding_repeats` makes each start obey the rule below.
2. `pair_swaps`: the i-th busiest GPU (by time) swaps a slot with the i-th idlest, all pairs at
   once, a few rounds: most of the way, in milliseconds.
3. `refine_time`: a local search that lowers the busiest GPU's time (ties: the sum of squared
   times), one move at a time: swap two slots on different GPUs, or give a slot to another expert
   (every expert keeps a slot; replica counts change). Only moves that touch the busiest GPU can
   lower it, so only those are tried. It runs from the best start after step 2 first, and stops
   within 0.1 % of the fluid bound (total load over total speed).

Padding. With an expert's load split evenly over its replicas, two ranks with distinct experts
each always get half of a uniform load whatever the placement: a slow rank can carry less only by
holding fewer distinct experts, its spare slots repeating its own. A GPU may therefore hold an
expert in several slots, but only when no other GPU holds it (all its copies there): the runtime
sends a pair to a replica on its own rank first, so a second local copy of a shared expert would
not take the share the model gives it; padding is the one case where the model and the runtime
agree (`placement_math.repeats_only_as_padding`). Every move keeps that rule for the experts it
touches.

With the placement in force, `time_minimal_movement` keeps, repairs (the same search from the
placement in force, stopped once within tolerance) or takes the speed-aware plan with each GPU's
experts kept in their slots, renaming GPUs only among GPUs of equal speed (renaming GPUs of
different speeds would change their times).

Sizes: L layers, E experts, P slots, W GPUs, S = P // W slots per GPU; speeds [W].
"""

from __future__ import annotations

import numpy as np

from .movement import align_slots
from .packing import replicas_in_order
from .placement_math import gpu_load, holders, repeats_only_as_padding, replica_counts_of

# The slot-by-slot search pairs the busiest GPU with this many idlest GPUs (by time) only: the best
# moves off it usually go there, and small arrays keep a round cheap. On the 58 x 256 benchmark
# shape with hot experts, 4 took 0.6 s for 12 layers at the balance 8 gave in 1.6 s and 16 in 3.0 s.
_TOP_PARTNERS = 4
# A move must lower the busiest time (or, at equal busiest time, the sum of squared times) by more
# than this share: floating-point noise must not count as progress.
_TOL = 1e-12
# A layer whose busiest time is within this share of the fluid bound (total load over total speed)
# is finished: no placement can go below that bound.
_GAP = 1e-3


def max_times(load: np.ndarray, pmap: np.ndarray, rank_speed: np.ndarray) -> np.ndarray:
    """[L, E] load, [L, P] placement, [W] speeds -> [L] the busiest GPU's time (load / speed)."""
    return (gpu_load(load, pmap, rank_speed.shape[0]) / rank_speed[None, :]).max(axis=1)


def time_lpt_pack(load: np.ndarray, counts: np.ndarray, rank_speed: np.ndarray,
                  num_slots: int | None = None) -> np.ndarray:
    """[L, E] load, [L, E] replica counts (rows summing to P' <= num_slots), [W] speeds -> [L, P]
    placement, P = num_slots (default P').

    Each replica, heaviest first, goes to the GPU with a free slot that (1) does not hold the expert
    and (2) finishes first with it, (load + w) / speed; the first GPU on ties. With fewer replicas
    than slots, a GPU's empty slots repeat its single-replica experts in turn (padding: a slow GPU
    that took few experts keeps them to itself). When every GPU with a free slot holds the expert,
    or a GPU has no single-replica expert to repeat, the row may break the padding rule: the
    caller checks it.
    """
    load = np.asarray(load, dtype=np.float64)
    L, E = load.shape
    W = rank_speed.shape[0]
    items_per_row = int(counts[0].sum())
    P = items_per_row if num_slots is None else int(num_slots)
    S = P // W
    rows = np.arange(L)
    items, weights = replicas_in_order(load, counts)
    # key = finish time scaled into [0, 1) + 2 when the GPU holds the expert + 4 when it is full:
    # the integer flags dominate, a lexicographic order in one argmin.
    scale = load.sum(axis=1) / rank_speed.min() * (1.0 + 1e-9) + 1.0  # [L], above any finish time
    loads = np.zeros((L, W))
    fill = np.zeros((L, W), dtype=np.int64)
    held = np.zeros((L, E, W), dtype=bool)
    gpu_of_item = np.empty((L, items_per_row), dtype=np.int64)
    for k in range(items_per_row):
        expert = items[:, k]
        finish = (loads + weights[:, k, None]) / rank_speed[None, :]
        # Once the replicas left only just cover the GPUs still empty, they go there: a GPU must
        # hold an expert of its own to pad with.
        must_fill = ((fill == 0).sum(axis=1) >= items_per_row - k)[:, None] & (fill > 0)
        key = finish / scale[:, None] + 2.0 * held[rows, expert] + 4.0 * ((fill >= S) | must_fill)
        gpu = np.argmin(key, axis=1)
        gpu_of_item[:, k] = gpu
        loads[rows, gpu] += weights[:, k]
        fill[rows, gpu] += 1
        held[rows, expert, gpu] = True
    order = np.argsort(gpu_of_item, axis=1, kind="stable")
    packed = np.take_along_axis(items, order, axis=1)
    if items_per_row == P:
        return packed
    out = np.empty((L, W, S), dtype=np.int64)
    for layer in range(L):
        start = 0
        for gpu in range(W):
            mine = packed[layer, start:start + fill[layer, gpu]]
            start += fill[layer, gpu]
            out[layer, gpu, :mine.size] = mine
            if mine.size < S:
                out[layer, gpu, mine.size:] = _pads(mine, counts[layer], S - mine.size)
    return out.reshape(L, P)


def _pads(mine: np.ndarray, counts: np.ndarray, n: int) -> np.ndarray:
    """Experts for a GPU's n empty slots: its single-replica experts in turn (spreading the extra
    copies keeps each expert's slot count low under a cap); else (it holds none) its first expert,
    or expert 0 when it holds nothing, which breaks the padding rule (the caller drops the row)."""
    alone = mine[counts[mine] == 1]
    if alone.size:
        return np.resize(alone, n)
    return np.full(n, mine[0] if mine.size else 0)


def small_count_vectors(num_experts: int, num_slots: int, num_gpus: int, limit: int = 64) -> np.ndarray | None:
    """Every replica-count vector [C, E] with 1 to W replicas per expert and E to P replicas in all
    (the rest of the P slots padding), or None when there are more than `limit`: small layers can
    afford a seed per vector, and which expert a fast rank should hold whole, and which to split,
    is what the water-filled counts get wrong there."""
    top = min(num_gpus, num_slots - num_experts + 1)
    out: list[list[int]] = []

    def extend(prefix: list[int], left_experts: int, left_slots: int) -> bool:
        if left_experts == 0:
            out.append(prefix)
            return len(out) <= limit
        for c in range(1, min(top, left_slots - (left_experts - 1)) + 1):
            if not extend(prefix + [c], left_experts - 1, left_slots - c):
                return False
        return True

    if not extend([], num_experts, num_slots):
        return None
    return np.array(out, dtype=np.int64)


def balance_time(load: np.ndarray, starts: list[np.ndarray], rank_speed: np.ndarray,
                 max_count: int | None = None) -> np.ndarray:
    """[L, E] load, starting placements (each [L, P]), [W] speeds -> [L, P] placement: per layer,
    `refine_time` from every start, keeping the result with the lowest busiest time (then sum of
    squared times) among those that repeat experts only as padding and hold no expert in more than
    `max_count` slots. Starts go through `pair_swaps` first and the search runs from the best of
    those first; the first result within 0.1 % of the fluid bound ends the layer. The first start is
    the fallback when none qualifies."""
    load = np.asarray(load, dtype=np.float64)
    L, E = load.shape
    W = rank_speed.shape[0]
    out = np.array(starts[0], dtype=np.int64, copy=True)
    cap = None if max_count is None else int(max_count)
    for layer in range(L):
        best_key = None
        # Within this share of the fluid bound (every GPU finishing together) the search stops:
        # the last rounds there buy almost nothing on big layers.
        good_enough = load[layer].sum() / rank_speed.sum() * (1.0 + _GAP)
        # The pair rounds take milliseconds; the slot-by-slot search after them is the cost, so it
        # runs from the most promising start first and the others are often skipped.
        paired = [pair_swaps(load[layer], only_padding_repeats(load[layer], start[layer], W), rank_speed)
                  for start in starts]
        paired.sort(key=lambda row: _objective(_row_times(load[layer], row, rank_speed)))
        for row in paired:
            row = refine_time(load[layer], row, rank_speed, cap, stop_max=good_enough)
            if not _row_allowed(row, E, W, cap):
                continue
            key = _objective(_row_times(load[layer], row, rank_speed))
            if best_key is None or key < best_key:
                best_key, out[layer] = key, row
            if best_key[0] <= good_enough:
                break
    return out


def only_padding_repeats(load_row: np.ndarray, row: np.ndarray, num_gpus: int) -> np.ndarray:
    """[E] load, [P] placement -> [P] placement where no GPU holds a shared expert twice (a start for
    the search, whose moves never touch an expert that breaks the rule): each extra local copy of a
    shared expert becomes a pad of an expert alone on that GPU, else a first copy there of the
    lightest expert that repeats nowhere (it becomes shared)."""
    row = np.array(row, dtype=np.int64, copy=True)
    E, P = load_row.shape[0], row.shape[0]
    S = P // num_gpus
    gpu_of_slot = np.arange(P) // S
    for _ in range(P):
        hold = np.bincount(row * num_gpus + gpu_of_slot, minlength=E * num_gpus).reshape(E, num_gpus)
        spans, most = (hold > 0).sum(axis=1), hold.max(axis=1)
        bad = np.flatnonzero((spans > 1) & (most > 1))
        if not bad.size:
            break
        expert = int(bad[0])
        gpu = int(np.argmax(hold[expert]))
        slot = int(np.flatnonzero((row == expert) & (gpu_of_slot == gpu))[-1])
        alone = np.flatnonzero((spans == 1) & (hold[:, gpu] > 0))
        free = np.flatnonzero((hold[:, gpu] == 0) & (most <= 1))
        if alone.size:
            row[slot] = alone[0]
        elif free.size:
            row[slot] = free[np.argmin(load_row[free])]
        else:
            break  # nothing can take the slot; the caller drops a row that still breaks the rule
    return row


def pair_swaps(load_row: np.ndarray, row: np.ndarray, rank_speed: np.ndarray, stop_max: float = 0.0,
               max_rounds: int = 400) -> np.ndarray:
    """[E] load, [P] placement, [W] speeds -> [P] placement with the same replica counts: rounds that
    pair the i-th busiest GPU (by time) with the i-th idlest and make, in every pair at once, the
    swap of one slot each that lowers the pair's larger time most. Moves most of the way in few
    rounds (one move per round off the busiest GPU alone takes hundreds on big layers). A GPU whose
    time is at most `stop_max` is left alone (the movement planner's target: each swap costs two
    rewritten slots). Each
    applied swap lowers its pair's larger time and touches no other GPU, so the sorted vector of
    times falls every round and the loop ends."""
    row = np.array(row, dtype=np.int64, copy=True)
    E, P, W = load_row.shape[0], row.shape[0], rank_speed.shape[0]
    S = P // W
    K = W // 2
    gpu_of_slot = np.arange(P) // S
    share = load_row / np.maximum(np.bincount(row, minlength=E), 1)
    for _ in range(max_rounds):
        bins = row.reshape(W, S)
        weights = share[bins]  # [W, S]
        loads = weights.sum(axis=1)
        times = loads / rank_speed
        order = np.argsort(-times, kind="stable")
        heavy, light = order[:K], order[::-1][:K]
        # d = load moving from the heavy GPU p to the light one q, per (pair, slot of p, slot of q)
        d = weights[heavy][:, :, None] - weights[light][:, None, :]  # [K, S, S]
        t_p = (loads[heavy][:, None, None] - d) / rank_speed[heavy][:, None, None]
        t_q = (loads[light][:, None, None] + d) / rank_speed[light][:, None, None]
        gain = times[heavy][:, None, None] - np.maximum(t_p, t_q)
        gain[bins[heavy][:, :, None] == bins[light][:, None, :]] = -np.inf
        flat = gain.reshape(K, S * S)
        best = np.argmax(flat, axis=1)
        hold = np.bincount(row * W + gpu_of_slot, minlength=E * W).reshape(E, W)
        changed = False
        for k in np.argsort(-flat[np.arange(K), best], kind="stable"):
            if flat[k, best[k]] <= _TOL * max(times[heavy[k]], 1e-300):
                break
            if times[heavy[k]] <= stop_max:
                continue
            a, b = divmod(int(best[k]), S)
            p, q = int(heavy[k]), int(light[k])
            e, x = int(bins[p, a]), int(bins[q, b])
            e_row, x_row = hold[e].copy(), hold[x].copy()
            e_row[p] -= 1
            e_row[q] += 1
            x_row[q] -= 1
            x_row[p] += 1
            if not (_padding_ok(e_row) and _padding_ok(x_row)):
                continue
            hold[e], hold[x] = e_row, x_row  # later pairs check against the updated copies
            row[p * S + a], row[q * S + b] = x, e
            changed = True
        if not changed:
            break
    return row


def refine_time(load_row: np.ndarray, row: np.ndarray, rank_speed: np.ndarray, max_count: int | None = None,
                stop_max: float = 0.0, max_rounds: int | None = None) -> np.ndarray:
    """[E] load, [P] placement, [W] speeds -> [P] placement whose busiest GPU time is no higher.

    Each round makes the best move that touches the busiest GPU g (lowest new busiest time, then
    lowest sum of squared times) among: swap a slot of g with a slot elsewhere; give a slot of g to
    an expert that g or a partner holds; give a slot of a partner to an expert g holds (g's share of
    it falls). Partners: the 4 idlest GPUs (all others when W <= 5). Moves keep every expert in a
    slot, at most `max_count` slots per expert (None: no cap), and repeats on a GPU only as
    padding. Stops when no move improves,
    or once the busiest time is at most `stop_max` (the movement planner stops there)."""
    load_row = np.asarray(load_row, dtype=np.float64)
    row = np.array(row, dtype=np.int64, copy=True)
    E, P, W = load_row.shape[0], row.shape[0], rank_speed.shape[0]
    S = P // W
    cap = P if max_count is None else int(max_count)
    gpu_of_slot = np.arange(P) // S
    if max_rounds is None:
        max_rounds = 8 * P + 64
    for _ in range(max_rounds):
        hold = np.bincount(row * W + gpu_of_slot, minlength=E * W).reshape(E, W)  # copies per GPU
        count = hold.sum(axis=1)
        share = load_row / np.maximum(count, 1)
        loads = (hold * share[:, None]).sum(axis=0)
        times = loads / rank_speed
        top = float(times.max())
        if top <= stop_max or top <= 0.0:
            break
        g = int(np.argmax(times))
        sumsq = float((times ** 2).sum())
        others = np.argsort(times, kind="stable")
        others = others[others != g]
        move = _best_move(load_row, row, hold, count, share, loads, rank_speed, g, others[:_TOP_PARTNERS],
                          S, cap, top, sumsq)
        if move is None:
            break
        for slot, expert in move:
            row[slot] = expert
    return row


def _best_move(load_row: np.ndarray, row: np.ndarray, hold: np.ndarray, count: np.ndarray, share: np.ndarray,
               loads: np.ndarray, speed: np.ndarray, g: int, partners: np.ndarray, S: int, cap: int, top: float,
               sumsq: float) -> list[tuple[int, int]] | None:
    """The best improving move off busiest GPU g with the GPUs in `partners` (any expert that g or
    they hold may take a slot of g), as [(slot, new expert), ...], or None.

    Which moves keep the padding rule is decided per expert from its copies (no [.., W] rows);
    swaps change two GPUs, so their busiest time comes from the top three; moves that change
    replica counts change every holder of the two experts and are evaluated as whole load vectors,
    only for the few that pass the rule (an expert must have a copy to spare)."""
    E, W = hold.shape
    on_g = np.arange(g * S, (g + 1) * S)
    off_g = (partners[:, None] * S + np.arange(S)[None, :]).ravel()
    e_g, e_off = row[on_g], row[off_g]  # [S], [T]
    h = off_g // S  # [T] GPU of each slot off g
    T = off_g.size
    spans = (hold > 0).sum(axis=1)  # [E] GPUs holding each expert
    most = hold.max(axis=1)  # [E] most copies on one GPU
    valid = (spans <= 1) | (most <= 1)  # experts that keep the rule now (moves may not touch others)
    times = loads / speed

    # Swaps: slot a of g (expert e) with slot b off g (expert x); counts do not change.
    delta = share[e_off][None, :] - share[e_g][:, None]  # [S, T] load g gains, b's GPU loses
    t_g = (loads[g] + delta) / speed[g]
    t_h = (loads[h][None, :] - delta) / speed[h][None, :]
    rest = times.copy()
    rest[g] = -np.inf
    first = int(np.argmax(rest))
    without_first = rest.copy()
    without_first[first] = -np.inf
    others = np.where(h == first, without_first.max(), rest[first])  # [T] busiest GPU not g nor h
    swap_peak = np.maximum(np.maximum(t_g, t_h), others[None, :])
    swap_squares = sumsq - times[g] ** 2 - (times[h] ** 2)[None, :] + t_g ** 2 + t_h ** 2
    swap_ok = ((e_g[:, None] != e_off[None, :]) & _moves_ok(hold, spans, most, valid, e_g[:, None], g, h[None, :])
               & _moves_ok(hold, spans, most, valid, e_off[None, :], h[None, :], g))
    swap_peak = np.where(swap_ok, swap_peak, np.inf)

    # Slot a of g from expert e (a copy to spare) to an expert f; slot b off g from expert x
    # (a copy to spare) to an expert f that g holds (g's share of f falls).
    takers = np.unique(np.concatenate([e_g, e_off]))
    mine = np.unique(e_g)
    give = (e_g[:, None] != takers[None, :]) & ((count[e_g] >= 2) & valid[e_g])[:, None] \
        & (_adds_ok(hold, spans, most, valid, takers, g) & (count[takers] + 1 <= cap))[None, :]
    take = (mine[:, None] != e_off[None, :]) & ((count[e_off] >= 2) & valid[e_off])[None, :] \
        & _adds_ok(hold, spans, most, valid, mine[:, None], h[None, :]) & (count[mine] + 1 <= cap)[:, None]
    ga, gf = np.nonzero(give)
    tf, tb = np.nonzero(take)
    # (slot, expert losing it, GPU of the slot, expert gaining it) for every count-changing move
    slots = np.concatenate([on_g[ga], off_g[tb]])
    losers = np.concatenate([e_g[ga], e_off[tb]])
    gpus = np.concatenate([np.full(ga.size, g), h[tb]])
    gainers = np.concatenate([takers[gf], mine[tf]])
    new_loads = loads + _copy_change(load_row, hold, count, share, losers, gpus, -1) \
        + _copy_change(load_row, hold, count, share, gainers, gpus, +1)  # [M, W]
    new_times = new_loads / speed
    give_peak = new_times.max(axis=1) if slots.size else np.empty(0)
    give_squares = (new_times ** 2).sum(axis=1)

    peak = np.concatenate([swap_peak.ravel(), give_peak])
    squares = np.concatenate([swap_squares.ravel(), give_squares])
    best_peak = peak.min() if peak.size else np.inf
    if not np.isfinite(best_peak):
        return None
    near = np.flatnonzero(peak <= best_peak + _TOL * top)
    pick = int(near[np.argmin(squares[near])])
    better = peak[pick] < top * (1.0 - _TOL) or (peak[pick] <= top * (1.0 + _TOL) and squares[pick] < sumsq * (1.0 - _TOL))
    if not better:
        return None
    if pick < S * T:
        a, b = divmod(pick, T)
        return [(int(on_g[a]), int(e_off[b])), (int(off_g[b]), int(e_g[a]))]
    pick -= S * T
    return [(int(slots[pick]), int(gainers[pick]))]


def _moves_ok(hold: np.ndarray, spans: np.ndarray, most: np.ndarray, valid: np.ndarray, expert: np.ndarray,
              src: np.ndarray | int, dst: np.ndarray | int) -> np.ndarray:
    """True where moving one copy of `expert` from GPU src to GPU dst (broadcast arrays) keeps the
    padding rule: a spread expert may go to a GPU without it (or join its only other GPU: all
    copies there); an expert alone on src with one or two copies may send one away."""
    spread = (most[expert] <= 1) & ((hold[expert, dst] == 0) | (spans[expert] == 2))
    alone = (spans[expert] == 1) & (hold[expert, src] <= 2)
    return valid[expert] & (spread | alone)


def _adds_ok(hold: np.ndarray, spans: np.ndarray, most: np.ndarray, valid: np.ndarray, expert: np.ndarray,
             dst: np.ndarray | int) -> np.ndarray:
    """True where one more copy of `expert` on GPU dst keeps the padding rule: another pad on its
    only GPU, or a first copy on dst of an expert with no repeats."""
    here = hold[expert, dst]
    return valid[expert] & (((here >= 1) & (spans[expert] == 1)) | ((here == 0) & (most[expert] <= 1)))


def _copy_change(load_row: np.ndarray, hold: np.ndarray, count: np.ndarray, share: np.ndarray,
                 experts: np.ndarray, gpus: np.ndarray, step: int) -> np.ndarray:
    """[M] experts each gaining (step +1) or losing (-1) one copy on GPU gpus[m] -> [M, W] change of
    every GPU's load (an expert's load stays split evenly over its copies)."""
    rows = hold[experts].astype(np.float64)
    rows[np.arange(experts.size), gpus] += step
    after = load_row[experts] / np.maximum(count[experts] + step, 1)
    return rows * after[:, None] - hold[experts] * share[experts][:, None]


def _padding_ok(copies: np.ndarray) -> np.ndarray:
    """[..., W] copies of one expert per GPU -> [...] True when it repeats on a GPU only as padding
    (all its copies on that GPU)."""
    return ((copies > 0).sum(axis=-1) <= 1) | (copies.max(axis=-1) <= 1)


def _row_times(load_row: np.ndarray, row: np.ndarray, rank_speed: np.ndarray) -> np.ndarray:
    return gpu_load(load_row[None, :], row[None, :], rank_speed.shape[0])[0] / rank_speed


def _objective(times: np.ndarray) -> tuple[float, float]:
    return float(times.max()), float((times ** 2).sum())


def _row_allowed(row: np.ndarray, num_experts: int, num_gpus: int, cap: int | None) -> bool:
    counts = np.bincount(row, minlength=num_experts)
    if counts.min() < 1 or (cap is not None and counts.max() > cap):
        return False
    return bool(repeats_only_as_padding(row[None, :], num_experts, num_gpus)[0])


def time_minimal_movement(load: np.ndarray, current: np.ndarray, plan: np.ndarray, rank_speed: np.ndarray,
                          tolerance: float = 0.005, max_count: int | None = None) -> tuple[np.ndarray, dict]:
    """[L, E] load, [L, P] placement in force, [L, P] speed-aware plan, [W] speeds -> ([L, P] new
    plan, facts). Every layer's busiest time ends at most the plan's / (1 - tolerance): the layer
    in force when it already is ("kept"), else the search from it stopped there ("repaired") or the
    plan aligned to it ("renamed"), whichever moves fewer slots."""
    load = np.asarray(load, dtype=np.float64)
    L, E = load.shape
    W = rank_speed.shape[0]
    target = max_times(load, plan, rank_speed) / (1.0 - tolerance)
    now = max_times(load, current, rank_speed)
    out = current.copy()
    how = ["kept"] * L
    todo = np.flatnonzero(now > target)
    if todo.size == 0:
        return out, {"how": how}
    renamed = align_within_speed_groups(plan[todo], current[todo], rank_speed)
    for i, layer in enumerate(todo):
        # Pair rounds first: on a plan far from balanced in time they reach the target in fewer
        # rewritten slots (and a fraction of the time) than single moves alone.
        paired = pair_swaps(load[layer], current[layer], rank_speed, stop_max=float(target[layer]))
        repaired = refine_time(load[layer], paired, rank_speed, max_count, stop_max=float(target[layer]))
        reached = max_times(load[layer:layer + 1], repaired[None], rank_speed)[0] <= target[layer]
        fewer = (repaired != current[layer]).sum() <= (renamed[i] != current[layer]).sum()
        if reached and fewer and _row_allowed(repaired, E, W, max_count):
            out[layer], how[layer] = repaired, "repaired"
        else:
            out[layer], how[layer] = renamed[i], "renamed"
    return out, {"how": how}


def align_within_speed_groups(new: np.ndarray, current: np.ndarray, rank_speed: np.ndarray) -> np.ndarray:
    """[L, P] new and current placements, [W] speeds -> [L, P] new with GPUs renamed only among GPUs
    of equal speed (so every GPU's time is kept) to share the most experts with `current`, and each
    GPU's experts kept in the slots they hold now (movement.align_slots)."""
    from scipy.optimize import linear_sum_assignment  # imported on first use: see cost._nnls_fit

    L, P = new.shape
    W = rank_speed.shape[0]
    S = P // W
    E = int(max(new.max(), current.max())) + 1
    rename = np.broadcast_to(np.arange(W), (L, W)).copy()  # new GPU a becomes GPU rename[l, a]
    groups = [np.flatnonzero(rank_speed == v) for v in np.unique(rank_speed)]
    groups = [grp for grp in groups if grp.size > 1]
    if groups:
        held_new = (holders(new, E, W) > 0).astype(np.float64)
        held_cur = (holders(current, E, W) > 0).astype(np.float64)
        overlap = np.einsum("lea,leb->lab", held_new, held_cur)  # [L, W, W], no BLAS threads
        for layer in range(L):
            for grp in groups:
                rows, cols = linear_sum_assignment(-overlap[layer][np.ix_(grp, grp)])
                rename[layer, grp[rows]] = grp[cols]
    renamed = np.empty_like(new)
    renamed.reshape(L, W, S)[np.arange(L)[:, None], rename] = new.reshape(L, W, S)
    return align_slots(renamed, current, W)


def replica_counts_fit(pmap: np.ndarray, num_experts: int, max_count: int | None) -> np.ndarray:
    """[L, P] placement -> [L] True where no expert holds more than max_count slots."""
    if max_count is None:
        return np.ones(pmap.shape[0], dtype=bool)
    return replica_counts_of(pmap, num_experts).max(axis=1) <= max_count
