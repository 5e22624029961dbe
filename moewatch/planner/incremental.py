"""A placement mended where it stands, fast enough to run inside an engine's own rebalance call.

vLLM and SGLang call their rebalancing function on every rank, inside a budget of tens of
milliseconds for a whole model. A from-scratch solve plus a minimal-movement alignment
(movement.py) spends most of that budget on a plan it then mostly throws away. Here the work starts
from the placement in force and stops as soon as the layer is good enough, so a layer that is
already balanced costs nothing and a drifting one costs a handful of moves:

1. the target: the busiest GPU may carry at most bound / (1 - tolerance), where the bound
   max(mean GPU load, heaviest replica under the best replica counts) is what no placement beats;
2. replica counts: while some replica is heavier than the best counts allow (times 1 + tolerance),
   the expert that can best spare a slot gives its replica on its least-loaded GPU to the expert
   running hot (one slot rewritten per count change);
3. swaps: while the busiest GPU is over the target, swap one of its replicas with one on another
   GPU (the 16 idlest first, every GPU when none of those helps; a layer that misses its target
   that way with every share of step 2 tries them again with four busy GPUs a round, 4 partners
   each): among the swaps that bring it down to the target the one that rewrites the fewest slots
   (and of those the one that moves the least load), else the one that lowers it most.
Every step is done for all layers at once; the loops run over moves, not layers. A layer that ends
over its target is reported, so the caller can fall back to the full solve for it alone.

Sizes: L layers, E experts, P slots, W GPUs, S = P // W slots per GPU, K idlest partners.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from . import mending_compiled
from .placement_math import replica_counts_of
from .replicate import capped_replica_counts, counts_at_threshold

@dataclass(frozen=True)
class RoundShape:
    """How the swap rounds look: up to `heavy` GPUs over the target each make a swap per round, each
    with its own `partners` idlest GPUs (disjoint); the busiest looks at its `busiest_partners`
    idlest when its share has no swap that reaches the target (at or above W: only when it has no
    swap at all), then at every GPU."""

    heavy: int
    partners: int
    busiest_partners: int


# Tried in this order while a layer misses its target, each with every share of HEAVY_SHARES before
# the next shape (_one_pass). One busy GPU a round, choosing among 16 partners after the last swap
# has landed, rewrites fewer slots, but alone it gets stuck on more small layers (24 of 864 at 8 to
# 32 GPUs missed their target, against 15 with four busy GPUs a round); those get the second shape.
# Both: 10 of 864 missed, and at 61 x 256, 320 slots, 64 GPUs, 5 to 9 % fewer slots were rewritten
# than with the second shape alone, at the same or higher balancedness.
ROUND_SHAPES = (RoundShape(heavy=1, partners=16, busiest_partners=64),
                RoundShape(heavy=4, partners=4, busiest_partners=12))
# A replica may carry this share of the target busiest load before its expert is given another
# slot; tried in this order per layer, within each round shape. High shares change few counts but
# can leave a replica too heavy to pack (hot-expert loads); 0 goes down to the best counts. At 61 x
# 256, 320 slots, 64 GPUs, 0.6 reached the target on every lognormal and hot-expert layer and on 7
# to 18 of 61 Zipf ones (4 seeds); 0.75 on 60 or 61 of the rest, rewriting 7 to 10 % fewer slots
# than 0.85, which reaches every Zipf layer and stays as the next try.
HEAVY_SHARES = (0.6, 0.75, 0.85, 0.0)
# A layer where the first share changes more counts than the second by more than this share of the
# GPUs tries the second first. Many experts heavier than the first share (a Zipf load) each split
# once more, and the extra replicas crowd the swaps: at 61 x 256, 320 slots, 64 GPUs, 8 nodes the
# first share reached 4 of 61 Zipf layers (14 more count changes a layer, a median) and its tries
# took most of the call, and the second rewrote fewer slots on 28 to 30 of 30 (3 seeds). On a
# hot-expert load (5 more) the first share rewrote fewer slots on 59 of 61; on a lognormal one
# (8.5 more) the two were even. At 32 GPUs (9 slots each) Zipf's layers differ by 6.
SECOND_SHARE_FIRST_AT = 1.0 / 6.0
# Swap rounds between checks that the busiest GPU came down by the tolerance (else the layer stops).
STALL_ROUNDS = 16
# Passes over a layer that misses its target, while each lowers its busiest GPU by the tolerance.
MAX_PASSES = 6
# A swap must lower the busiest GPU of its pair by more than this share of its load.
_MIN_GAIN = 1e-9


@dataclass(frozen=True)
class Repair:
    """A mended placement and what it reached."""

    physical_to_logical_map: np.ndarray  # [L, P] int64
    target_max: np.ndarray  # [L] the busiest GPU load aimed for
    busiest: np.ndarray  # [L] the busiest GPU load reached
    reached: np.ndarray  # [L] bool: busiest <= target_max
    count_changes: np.ndarray  # [L] slots rewritten to change replica counts
    swaps: np.ndarray  # [L] swaps made


def best_busiest_bound(load: np.ndarray, num_slots: int, num_gpus: int) -> np.ndarray:
    """[L, E] load -> [L] max(mean GPU load, heaviest replica under the best replica counts of at
    most W replicas an expert): no placement's busiest GPU carries less. (An expert with c > W
    replicas has ceil(c / W) of them on some GPU, which then carries at least its load / W: more
    than W replicas never lighten the busiest GPU.)"""
    return _bound_and_heaviest(load, num_slots, num_gpus)[0]


def _bound_and_heaviest(load: np.ndarray, num_slots: int, num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """[L, E] load -> ([L] best_busiest_bound, [L] the heaviest replica under the best counts capped
    at W)."""
    heaviest = (load / capped_replica_counts(load, num_slots, num_gpus)).max(axis=1)
    return np.maximum(load.sum(axis=1) / num_gpus, heaviest), heaviest


def _within(busiest: np.ndarray, target_max: np.ndarray) -> np.ndarray:
    """[A] busiest GPU loads at or under their targets (rounding aside)."""
    return busiest <= target_max * (1.0 + 1e-12)


def repair_placement(load: np.ndarray, current: np.ndarray, num_gpus: int, tolerance: float,
                     num_nodes: int = 1, max_moves: int | None = None) -> Repair:
    """[L, E] load, [L, P] valid placement in force -> Repair with an [L, P] placement whose busiest
    GPU is within `tolerance` of the bound wherever these moves can get it there.

    Replica counts change only where a replica is heavier than HEAVY_SHARES allow; a layer that
    misses its target with the first share is tried again with the next ones, and keeps the try
    that reaches the target with the fewest rewritten slots (else the one with the lightest
    busiest GPU); a layer still short of it gets further passes while they gain (MAX_PASSES). Swaps
    never put a second replica of an expert on a GPU and, among equally good ones, stay inside a
    node (num_nodes > 1): its links are the faster. max_moves caps the count changes plus swaps
    per layer (default 4 x P)."""
    load = np.asarray(load, dtype=np.float64)
    current = np.asarray(current, dtype=np.int64)
    L, E = load.shape
    P = current.shape[1]
    W = num_gpus
    bound, heaviest = _bound_and_heaviest(load, P, W)
    target_max = bound / (1.0 - tolerance)
    best_counts_heaviest = heaviest * (1.0 + tolerance)
    budget = np.full(L, 4 * P if max_moves is None else int(max_moves), dtype=np.int64)
    now = _gpu_loads(load, current, W).max(axis=1)
    result = Repair(current.copy(), target_max, now, _within(now, target_max),
                    np.zeros(L, dtype=np.int64), np.zeros(L, dtype=np.int64))
    todo = np.flatnonzero(~result.reached)  # a layer already within its target is left alone
    for _ in range(MAX_PASSES):
        if not todo.size:
            break
        left = budget[todo] - result.count_changes[todo] - result.swaps[todo]
        tried = _one_pass(load[todo], result.physical_to_logical_map[todo], W, num_nodes, target_max[todo],
                          best_counts_heaviest[todo], left, tolerance)
        # A pass counts when it reaches the target or lowers the busiest GPU by more than the
        # tolerance; a layer out of reach gets passes until one gains less. So the result is a fixed
        # point: the same load from it repeats that last pass, which is not taken, and moves nothing.
        gained = tried.reached | (tried.busiest < result.busiest[todo] * (1.0 - tolerance))
        keep = todo[gained]
        result.physical_to_logical_map[keep] = tried.physical_to_logical_map[gained]
        result.busiest[keep] = tried.busiest[gained]
        result.reached[keep] = tried.reached[gained]
        result.count_changes[keep] += tried.count_changes[gained]
        result.swaps[keep] += tried.swaps[gained]
        todo = todo[gained & ~tried.reached]
    return result


def _one_pass(load: np.ndarray, start: np.ndarray, num_gpus: int, num_nodes: int, target_max: np.ndarray,
              best_counts_heaviest: np.ndarray, budget: np.ndarray, progress: float) -> Repair:
    """One mending of each layer of `start` [A, P] for each of ROUND_SHAPES and, within a shape, each
    share in HEAVY_SHARES (the second before the first on a layer where SECOND_SHARE_FIRST_AT says),
    as long as the layer misses its target; keeps the try `_better_of` prefers.
    Moves are counted from `start`, so a pass is a function of where it starts alone (what makes the
    result a fixed point).

    Shapes outside, shares inside: a layer that one share's first shape leaves short of its target
    goes on to the next share's first shape before any share's second. On the EPLB benchmark's Zipf
    load at 64 GPUs the first share's first shape reached 2 of 61 layers and its second shape 5 more,
    at a third of the call; the next share's first shape reaches most of them, with as few or fewer
    slots rewritten."""
    A = load.shape[0]
    # No try yet: a layer's first try replaces this whatever it reached (its busiest is lighter).
    best = Repair(start.copy(), target_max, np.full(A, np.inf), np.zeros(A, dtype=bool),
                  np.zeros(A, dtype=np.int64), np.zeros(A, dtype=np.int64))
    todo = np.arange(A)
    # Per share: its limits, and where they equal an earlier share's (the same limit gives the same
    # mending, and the same round shape was tried on it: skipped).
    shares: list[tuple[np.ndarray, np.ndarray]] = []
    for share in HEAVY_SHARES:
        limits = np.maximum(best_counts_heaviest, share * target_max)
        repeat = np.zeros(A, dtype=bool)
        for seen, _ in shares:
            repeat |= limits == seen
        shares.append((limits, repeat))
    # The counts mended once per share and layer; every round shape starts from them.
    mended = np.empty((len(shares),) + start.shape, dtype=np.int64)
    counts = np.zeros((len(shares), A), dtype=np.int64)
    counted = np.zeros((len(shares), A), dtype=bool)

    def mend(i: int, layers: np.ndarray) -> None:
        fresh = layers[~counted[i, layers]]
        if fresh.size:
            rows = start[fresh].copy()
            counts[i, fresh] = _mend_counts(load[fresh], rows, num_gpus, shares[i][0][fresh], budget[fresh])
            mended[i, fresh] = rows
            counted[i, fresh] = True

    # Each layer's order of shares: HEAVY_SHARES', but the second before the first where the first
    # needs more than a sixth of the GPUs' count more new replicas (SECOND_SHARE_FIRST_AT).
    order = np.tile(np.arange(len(shares))[:, None], (1, A))
    if len(shares) > 1:
        # the new replicas a share's limit asks for (where givers last out, the count changes it makes)
        held = replica_counts_of(start, load.shape[1])
        extra = (np.maximum(counts_at_threshold(load, shares[0][0]) - held, 0)
                 - np.maximum(counts_at_threshold(load, shares[1][0]) - held, 0)).sum(axis=1)
        second_first = extra > SECOND_SHARE_FIRST_AT * num_gpus
        order[0, second_first], order[1, second_first] = 1, 0
    # per round shape, per step of the layers' orders, the layers whose share at that step is i
    for shape, step, i in itertools.product(ROUND_SHAPES, range(len(shares)), range(len(shares))):
        if not todo.size:
            break
        run = todo[(order[step, todo] == i) & ~shares[i][1][todo]]
        if not run.size:
            continue
        mend(i, run)
        sub_load, row, sub_counts = load[run], mended[i, run], counts[i, run]  # (a copy: fancy index)
        swaps = _swap_down(sub_load, row, start[run], num_gpus, num_nodes, target_max[run],
                           budget[run] - sub_counts, progress, shape)
        busiest = _gpu_loads(sub_load, row, num_gpus).max(axis=1)
        tried = Repair(row, target_max[run], busiest, _within(busiest, target_max[run]), sub_counts, swaps)
        best = _better_of(best, tried, run, start)
        todo = np.flatnonzero(~best.reached)
    return best


def _better_of(best: Repair, tried: Repair, layers: np.ndarray, start: np.ndarray) -> Repair:
    """`best` [L] with layers `layers` replaced where `tried` (for those layers) is better: reached
    beats not reached; then fewer slots rewritten from `start` when both reached, else a lighter
    busiest GPU."""
    old_moves = (best.physical_to_logical_map[layers] != start[layers]).sum(axis=1)
    new_moves = (tried.physical_to_logical_map != start[layers]).sum(axis=1)
    old_ok, new_ok = best.reached[layers], tried.reached
    take = (new_ok & ~old_ok) | (new_ok & old_ok & (new_moves < old_moves)) | (
        ~new_ok & ~old_ok & (tried.busiest < best.busiest[layers]))
    out = {}
    for name in ("physical_to_logical_map", "busiest", "reached", "count_changes", "swaps"):
        merged = getattr(best, name).copy()
        merged[layers[take]] = getattr(tried, name)[take]
        out[name] = merged
    return Repair(target_max=best.target_max, **out)


def _slot_weights(load: np.ndarray, row: np.ndarray) -> np.ndarray:
    """[A, E] load, [A, P] placement -> [A, P] load of each slot (each expert split evenly)."""
    counts = replica_counts_of(row, load.shape[1])
    return np.take_along_axis(load / np.maximum(counts, 1), row, axis=1)


def _gpu_loads(load: np.ndarray, row: np.ndarray, num_gpus: int) -> np.ndarray:
    A, P = row.shape
    return _slot_weights(load, row).reshape(A, num_gpus, P // num_gpus).sum(axis=2)


@contextmanager
def _contiguous(row: np.ndarray):
    """`row` as the C-contiguous int64 array the compiled loops write into, copied back into `row`
    after them when it had to be a copy."""
    out = np.ascontiguousarray(row, dtype=np.int64)
    yield out
    if out is not row:
        row[...] = out


def _mend_counts(load: np.ndarray, row: np.ndarray, num_gpus: int, heaviest_allowed: np.ndarray,
                 budget: np.ndarray) -> np.ndarray:
    """_mend_counts_numpy, compiled where numba is installed (mending_compiled.py); -> [L] slots
    rewritten."""
    compiled = mending_compiled.kernel()
    if compiled is None:
        return _mend_counts_numpy(load, row, num_gpus, heaviest_allowed, budget)
    with _contiguous(row) as rewritten:
        load = np.ascontiguousarray(load, dtype=np.float64)
        limit = np.ascontiguousarray(heaviest_allowed, dtype=np.float64)
        budget = np.ascontiguousarray(budget, dtype=np.int64)
        return mending_compiled.over_layers(load.shape[0], lambda part: compiled.mend_counts(
            load[part], rewritten[part], int(num_gpus), limit[part], budget[part]))


def _mend_counts_numpy(load: np.ndarray, row: np.ndarray, num_gpus: int, heaviest_allowed: np.ndarray,
                       budget: np.ndarray) -> np.ndarray:
    """Rewrite slots of `row` [L, P] in place until no replica is over `heaviest_allowed` [L], no
    expert can spare a slot without going over, or the layer's budget [L] is spent; -> [L] slots
    rewritten.

    Each step the expert with the heaviest replica (the taker) gains a slot from the expert left
    lightest per replica by giving one up (the giver), on the giver's least-loaded GPU. Givers with
    a slot on a GPU that lacks the taker come first. The limit comes from counts of at most W
    replicas an expert (best_busiest_bound), so no expert is given more than the GPUs can use."""
    L, E = load.shape
    P = row.shape[1]
    S = P // num_gpus
    changes = np.zeros(L, dtype=np.int64)
    active = np.flatnonzero(budget > 0)
    slot_gpu = np.arange(P) // S
    counts = replica_counts_of(row, E)
    while active.size:
        sub_load, sub_row, sub_counts = load[active], row[active], counts[active]
        A = active.size
        ar = np.arange(A)
        per = sub_load / np.maximum(sub_counts, 1)
        taker = np.argmax(per, axis=1)
        taker_on_gpu = (sub_row == taker[:, None]).reshape(A, num_gpus, S).any(axis=2)
        slot_free = ~taker_on_gpu[:, slot_gpu]  # [A, P] a slot on a GPU without the taker
        free_of = np.bincount((ar[:, None] * E + sub_row).ravel(), weights=slot_free.ravel(),
                              minlength=A * E).reshape(A, E) > 0
        after = np.where(sub_counts >= 2, sub_load / np.maximum(sub_counts - 1, 1), np.inf)
        after[ar, taker] = np.inf
        # A giver with a slot on a GPU that lacks the taker first: a second replica on one GPU
        # lightens nothing until a swap moves it to a GPU without one (the swaps below do).
        giver = np.argmin(np.where(free_of, after, np.inf), axis=1)
        none_free = ~free_of[ar, giver] | ~np.isfinite(after[ar, giver])
        giver[none_free] = np.argmin(after[none_free], axis=1)
        limit = heaviest_allowed[active]
        go = (per[ar, taker] > limit) & (after[ar, giver] <= limit)
        if not go.any():
            break
        active, ar = active[go], ar[go]
        sub_row, taker, giver, slot_free = sub_row[go], taker[go], giver[go], slot_free[go]
        gpu = per[go][np.arange(ar.size)[:, None], sub_row].reshape(ar.size, num_gpus, S).sum(axis=2)
        # the giver's replica on its least-loaded GPU, one without the taker when it has one
        key = gpu[:, slot_gpu] + np.where(slot_free, 0.0, 1e300)
        key = np.where(sub_row == giver[:, None], key, np.inf)
        slot = np.argmin(key, axis=1)
        row[active, slot] = taker
        counts[active, taker] += 1
        counts[active, giver] -= 1
        changes[active] += 1
        active = active[changes[active] < budget[active]]
    return changes


def _swap_down(load: np.ndarray, row: np.ndarray, current: np.ndarray, num_gpus: int, num_nodes: int,
               target_max: np.ndarray, budget: np.ndarray, progress: float, shape: RoundShape) -> np.ndarray:
    """_swap_down_numpy's rounds, compiled where numba is installed (mending_compiled.py: the same
    swaps, bit for bit, in a fraction of the time); -> [L] swaps made."""
    weights = _slot_weights(load, row)  # swaps keep the counts, so each slot's load moves with it
    node_of = np.arange(num_gpus, dtype=np.int64) // (num_gpus // num_nodes)
    compiled = mending_compiled.kernel()
    if compiled is None:
        return _swap_down_numpy(row, weights, current, num_gpus, node_of, target_max, budget, progress, shape)
    with _contiguous(row) as swapped:
        weights = np.ascontiguousarray(weights)
        current = np.ascontiguousarray(current, dtype=np.int64)
        target_max = np.ascontiguousarray(target_max, dtype=np.float64)
        budget = np.ascontiguousarray(budget, dtype=np.int64)
        return mending_compiled.over_layers(row.shape[0], lambda part: compiled.swap_down(
            swapped[part], weights[part], current[part], target_max[part], budget[part], node_of, int(num_gpus),
            shape.heavy, shape.partners, shape.busiest_partners, STALL_ROUNDS, float(progress), _MIN_GAIN))


def _swap_down_numpy(row: np.ndarray, weights: np.ndarray, current: np.ndarray, num_gpus: int, node_of: np.ndarray,
                     target_max: np.ndarray, budget: np.ndarray, progress: float, shape: RoundShape) -> np.ndarray:
    """Swap replicas of `row` [L, P] in place (and their loads in `weights` [L, P] with them; node_of [W]
    is each GPU's node), off GPUs over target_max [L], until none is over, no
    swap lowers the busiest, the busiest has come down by less than `progress` (a share) over the
    last STALL_ROUNDS rounds (a target out of reach), or the layer's budget [L] is spent; -> [L]
    swaps made.

    Each round takes the M busiest GPUs over the target and gives each its own share of the idlest
    GPUs (disjoint, so all M swaps can land at once); the busiest GPU alone looks wider when its
    share has no swap for it that reaches the target."""
    L, P = row.shape
    W = num_gpus
    S = P // W
    M = max(1, min(shape.heavy, W // 4))
    K = max(1, min(shape.partners, (W - M) // M))
    swaps = np.zeros(L, dtype=np.int64)
    active = np.flatnonzero(budget > 0)
    checkpoint = np.full(L, np.inf)  # the busiest GPU's load STALL_ROUNDS rounds ago
    rounds = 0
    while active.size:
        w = weights[active].reshape(active.size, W, S)
        gpu = w.sum(axis=2)
        order = np.argsort(-gpu, axis=1, kind="stable")
        top = gpu[np.arange(active.size), order[:, 0]]
        over = ~_within(top, target_max[active])
        if rounds % STALL_ROUNDS == 0:
            over &= top < checkpoint[active] * (1.0 - progress)
            checkpoint[active] = top
        rounds += 1
        if not over.all():
            active, w, gpu, order, top = active[over], w[over], gpu[over], order[over], top[over]
            if not active.size:
                break
        A = active.size
        bins = row[active].reshape(A, W, S)
        heavy = order[:, :M]  # [A, M]
        # idle GPU of rank i (idlest first) goes to heavy GPU i mod M
        idle = order[:, ::-1][:, :M * K].reshape(A, K, M).transpose(0, 2, 1)  # [A, M, K]
        pick = _best_swaps(bins, w, gpu, heavy, idle, current[active], target_max[active], node_of)
        # The busiest must come down. When its share offers no swap that brings it to the target, it
        # looks wider: its busiest_partners idlest, then, with no swap there at all, every GPU. Its
        # swap is then the layer's only one this round: its partner may be another heavy GPU's.
        for wider in (shape.busiest_partners, W):
            short = np.flatnonzero(~pick[3][:, 0] if wider < W else pick[0][:, 0] < 0)
            if not short.size:
                continue
            partners = order[short][:, ::-1][:, None, :min(wider, W)]
            again = _best_swaps(bins[short], w[short], gpu[short], heavy[short, :1], partners, current[active[short]],
                                target_max[active[short]], node_of)
            found = again[0][:, 0] >= 0
            rows = short[found]
            for part, value in zip(pick, again):
                part[rows, 1:] = False if part.dtype == bool else -1
                part[rows, :1] = value[found]
        a, q, b, _ = pick
        a[np.arange(M)[None, :] >= (budget[active] - swaps[active])[:, None]] = -1  # the budget, swap by swap
        done_rows, done_cols = np.nonzero(a >= 0)
        if not done_rows.size:
            break
        lay = active[done_rows]
        p = heavy[done_rows, done_cols]
        src = p * S + a[done_rows, done_cols]
        dst = q[done_rows, done_cols] * S + b[done_rows, done_cols]
        e_src, e_dst = row[lay, src], row[lay, dst]
        row[lay, src], row[lay, dst] = e_dst, e_src
        weights[lay, src], weights[lay, dst] = weights[lay, dst], weights[lay, src]
        np.add.at(swaps, lay, 1)
        moved = np.unique(lay)
        active = moved[swaps[moved] < budget[moved]]
    return swaps


def _best_swaps(bins: np.ndarray, w: np.ndarray, gpu: np.ndarray, heavy: np.ndarray, partners: np.ndarray,
                current: np.ndarray, target_max: np.ndarray,
                node_of: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """[A, W, S] experts and loads, [A, W] GPU loads, [A, M] heavy GPUs, [A, M, K] each one's
    partner GPUs, [A, P] placement in force, [A] target, [W] node of each GPU -> (slot on the heavy GPU, partner GPU,
    slot there), each [A, M]; -1 where no swap helps or the heavy GPU is not over the target.

    Candidates are [A, M, S, K, S]; this is the solver's bulk, so loads are scaled by the heavy
    GPU's load once and every step below is one pass over them."""
    A, W, S = bins.shape
    M, K = partners.shape[1], partners.shape[2]
    a_ = np.arange(A)[:, None]
    a3 = np.arange(A)[:, None, None]
    e_h, e_q = bins[a_, heavy], bins[a3, partners]  # [A, M, S], [A, M, K, S]
    load_h = gpu[a_, heavy]  # [A, M]
    inv = 1.0 / np.maximum(load_h, 1e-300)
    w_h = w[a_, heavy] * inv[:, :, None]
    w_q = w[a3, partners] * inv[:, :, None, None]
    gap = (load_h[:, :, None] - gpu[a3, partners]) * inv[:, :, None]  # [A, M, K]
    need = (load_h - target_max[:, None]) * inv  # [A, M]
    # moving d = w_out - w_in off the heavy GPU lowers the pair's max by min(d, gap - d)
    d = w_h[:, :, :, None, None] - w_q[:, :, None, :, :]
    gain = np.minimum(d, gap[:, :, None, :, None] - d, out=d)
    # no second replica of an expert on one GPU (a swap of an expert with itself changes nothing)
    # (a partner that is the heavy GPU itself holds all its experts: never a swap)
    same = e_h[:, :, :, None, None] == e_q[:, :, None, :, :]
    h_on_q = same[..., 0].copy()  # [A, M, S, K]: OR over the short last axis, slice by slice (faster)
    q_on_h = same[:, :, 0].copy()  # [A, M, K, S]
    for t in range(1, S):
        h_on_q |= same[..., t]
        q_on_h |= same[:, :, t]
    useless = (gain <= _MIN_GAIN) | h_on_q[..., None] | q_on_h[:, :, None]
    # Swaps that bring the heavy GPU to the target rank above the rest: by fewest slots rewritten
    # (counted against the placement in force, plus half a slot for a swap across nodes: the weights
    # cross the slower link), then by the least gain that is enough (the partner is left the
    # lightest, for the next heavy GPU; on a drifting 61 x 256 load 2 % fewer slots moved than by
    # the most). Their score is 8 - rewrites (>= 5.5) plus a share under 1; the rest rank by gain
    # alone (scaled, < 1), and only the busiest may settle for one of them.
    cur = current.reshape(A, W, S)
    c_h, c_q = cur[a_, heavy], cur[a3, partners]
    kept_h = 8.0 + (e_h != c_h)  # [A, M, S] a slot already rewritten costs nothing more
    kept_q = (e_q != c_q) - 0.5 * (node_of[partners] != node_of[heavy][:, :, None])[:, :, :, None]
    score = kept_h[:, :, :, None, None] + kept_q[:, :, None, :, :]
    score -= e_q[:, :, None, :, :] != c_h[:, :, :, None, None]
    score -= e_h[:, :, :, None, None] != c_q[:, :, None, :, :]
    enough = gain >= need[:, :, None, None, None]
    score *= enough
    score += np.where(enough, 1.0 - gain, gain)
    useless[:, 1:] |= ~enough[:, 1:]
    useless |= (need <= 0)[:, :, None, None, None]
    np.putmask(score, useless, -np.inf)
    score = score.reshape(A, M, -1)
    best = np.argmax(score, axis=2)
    a_m = (np.arange(A)[:, None], np.arange(M)[None, :])
    ok = np.isfinite(score[a_m[0], a_m[1], best])
    a, rest = np.divmod(best, K * S)
    k, b = np.divmod(rest, S)
    q = partners[a_m[0], a_m[1], k]
    enough_best = ok & (score[a_m[0], a_m[1], best] > 2.0)  # an enough swap scores 5.5 or more
    return np.where(ok, a, -1), np.where(ok, q, -1), np.where(ok, b, -1), enough_best
