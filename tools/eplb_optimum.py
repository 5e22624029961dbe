"""The fewest slots any placement with given replica counts at a given balancedness rewrites: an integer
program per layer (scipy's HiGHS), for the EPLB benchmark only. The product never imports this module.

The question: from the placement in force, how few slots must be rewritten so that the busiest GPU
carries at most `target` (the balancedness a policy aimed for or reached), each expert holding the
replica counts `counts` (the policy's own, so its placement is one of those the program ranges
over)? Formulation, per layer:

- x[g, e] integer in [0, min(d_e, c_e)]: replicas of expert e on GPU g, at most d_e on one GPU (the
  most the policy's own placement puts on one GPU: one for moewatch's mending, which never doubles
  an expert on a GPU; HiGHS finds placements far sooner with x binary);
- sum_e x[g, e] = S (each GPU's slot count fixed), sum_g x[g, e] = c_e;
- sum_e (load_e / c_e) x[g, e] <= target (an even split over replicas, as the engines dispatch);
- k[g, e] <= x[g, e], k[g, e] <= m[g, e] for the (GPU, expert) pairs in force (m replicas of e on
  g now): the replicas kept;
- maximise sum k.

Slots rewritten = P - kept replicas (a kept replica stays in its slot, the others are filled anew),
a lower bound on the benchmark's count of slots whose expert changed, which also counts a kept
expert that a policy moved to another slot of its GPU. Every placement with these counts and the
busiest GPU at most `target` is feasible, so the integer optimum is at most its slots rewritten;
the LP relaxation (x, k continuous), rounded up, is at most the integer optimum and is what the
benchmark computes for every layer (fast); the integer program runs under a time limit on a sample
of layers.

Why the counts are given rather than free: with free counts the load a replica carries is load / c,
a product of two decisions; its linearisation (a count per expert between ceil(load / target) and W,
secants of load / c, big-M links) left the LP relaxation at a fifth of what the mending rewrites and
the integer program without a placement after 60 s on one layer at 256 experts, 320 slots, 64 GPUs.
The given counts make the program a transportation problem with one knapsack row per GPU, whose
relaxation is tight. The bound so answers "how few slots could a placement with this policy's
replica counts move", not "with any counts".

Sizes: E experts, P slots, W GPUs, S = P // W.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import asdict, dataclass

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

# Slack on the busiest GPU's limit, relative: a placement at exactly the target stays feasible
# whatever the rounding of its sums.
_TARGET_SLACK = 1e-9


@dataclass(frozen=True)
class Optimum:
    """What one solve of one layer found."""

    slots_rewritten_bound: int  # no placement at the target rewrites fewer (LP: rounded-up relaxation)
    slots_rewritten: int | None  # the integer program's best placement found (None: LP, or none found)
    optimal: bool  # slots_rewritten is proven the fewest (integer program finished)
    status: str  # "current map meets the target", "optimal", "time limit", "infeasible", "lp"
    seconds: float
    map_row: np.ndarray | None = None  # [P] the best placement found (integer program), kept slots in place

    def record(self) -> dict:
        out = asdict(self)
        out.pop("map_row")
        return out


def busiest_gpu_load(load: np.ndarray, row: np.ndarray, num_gpus: int) -> float:
    """[E] load, [P] placement -> the busiest GPU's load (even split over replicas)."""
    counts = np.bincount(row, minlength=load.shape[0])
    per_slot = load[row] / counts[row]
    return float(per_slot.reshape(num_gpus, -1).sum(axis=1).max())


def _program(load: np.ndarray, current: np.ndarray, counts: np.ndarray, max_per_gpu: np.ndarray, num_gpus: int,
             target: float):
    """The layer's program in scipy.optimize.milp's terms: (objective, integrality, bounds,
    constraints, number of x variables)."""
    E, P, W = load.shape[0], current.shape[0], num_gpus
    S = P // W
    per_replica = np.divide(load, counts, out=np.zeros(E), where=counts > 0) / (target * (1.0 + _TARGET_SLACK))
    held = np.zeros((W, E), dtype=np.int64)
    np.add.at(held, (np.repeat(np.arange(W), S), current), 1)
    held = held.ravel()
    kept_of = np.flatnonzero(held)  # x index of each pair in force
    nx, nk = W * E, kept_of.shape[0]
    n = nx + nk
    g_of = np.repeat(np.arange(W), E)
    e_of = np.tile(np.arange(E), W)
    ge = np.arange(nx)
    ik = np.arange(nk)
    blocks = [  # (rows, cols, values, lower, upper), rows numbered within the block
        (g_of, ge, np.ones(nx), np.full(W, S, float), np.full(W, S, float)),  # S slots a GPU
        (e_of, ge, np.ones(nx), counts.astype(float), counts.astype(float)),  # c_e replicas
        (g_of, ge, per_replica[e_of], np.full(W, -np.inf), np.ones(W)),  # the busiest under the target
        (np.concatenate([ik, ik]), np.concatenate([nx + ik, kept_of]),  # k - x <= 0
         np.concatenate([np.ones(nk), -np.ones(nk)]), np.full(nk, -np.inf), np.zeros(nk)),
    ]
    rows, cols, vals, lower, upper = [], [], [], [], []
    offset = 0
    for r, c, v, lb, ub in blocks:
        rows.append(r + offset)
        cols.append(c)
        vals.append(v)
        lower.append(lb)
        upper.append(ub)
        offset += lb.shape[0]
    matrix = sparse.csr_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                              shape=(offset, n))
    objective = np.concatenate([np.zeros(nx), -np.ones(nk)])  # maximise kept replicas
    ub = np.concatenate([np.minimum(max_per_gpu, counts)[e_of].astype(float), held[kept_of].astype(float)])
    integrality = np.concatenate([np.ones(nx), np.zeros(nk)])  # k is integral once x is
    return (objective, integrality, Bounds(np.zeros(n), ub),
            LinearConstraint(matrix, np.concatenate(lower), np.concatenate(upper)), nx)


def _row_from(x: np.ndarray, current: np.ndarray, num_gpus: int) -> np.ndarray:
    """The integer program's x [W, E] (replicas per GPU) -> a [P] placement that keeps each kept
    replica in its slot and fills the other slots in expert order."""
    S = current.shape[0] // num_gpus
    out = current.copy()
    for g in range(num_gpus):
        wanted = x[g].copy()
        free = []
        for s in range(g * S, (g + 1) * S):
            if wanted[current[s]] > 0:
                wanted[current[s]] -= 1
            else:
                free.append(s)
        fill = np.repeat(np.arange(wanted.shape[0]), wanted)
        if fill.shape[0] != len(free):
            raise RuntimeError(f"GPU {g}: {fill.shape[0]} replicas for {len(free)} free slots")
        out[free] = fill
    return out


def fewest_slots_rewritten(load: np.ndarray, current: np.ndarray, counts: np.ndarray, num_gpus: int,
                           target: float, integer: bool, time_limit: float = 30.0,
                           max_per_gpu: np.ndarray | None = None) -> Optimum:
    """[E] load, [P] placement in force, [E] replica counts (each >= 1, summing to P), the busiest
    GPU's limit, [E] the most replicas of an expert one GPU may hold (default 1) -> Optimum: the LP bound, and with `integer` the integer program's best placement
    within `time_limit` seconds. Raises ValueError on counts that do not fill the slots."""
    load = np.asarray(load, dtype=np.float64)
    current = np.asarray(current, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    P = current.shape[0]
    if counts.shape != load.shape or counts.min() < 1 or int(counts.sum()) != P or P % num_gpus:
        raise ValueError(f"replica counts must be >= 1 each and sum to the {P} slots, on GPUs of equal size")
    started = time.perf_counter()
    if max_per_gpu is None:
        max_per_gpu = np.ones_like(counts)
    max_per_gpu = np.minimum(P // num_gpus, np.asarray(max_per_gpu, dtype=np.int64))
    if (np.minimum(max_per_gpu, counts) * num_gpus < counts).any():
        raise ValueError("an expert has more replicas than its allowed replicas per GPU times the GPUs")
    held = np.zeros((num_gpus, load.shape[0]), dtype=np.int64)
    np.add.at(held, (np.repeat(np.arange(num_gpus), P // num_gpus), current), 1)
    if ((held.sum(axis=0) == counts).all() and (held <= max_per_gpu).all()
            and busiest_gpu_load(load, current, num_gpus) <= target * (1.0 + _TARGET_SLACK)):
        return Optimum(0, 0 if integer else None, integer, "current map meets the target",
                       time.perf_counter() - started, current.copy() if integer else None)
    objective, integrality, bounds, constraints, nx = _program(load, current, counts, max_per_gpu, num_gpus, target)
    relaxed = milp(objective, integrality=np.zeros_like(integrality), bounds=bounds, constraints=constraints)
    if relaxed.status == 2:
        return Optimum(P + 1, None, False, "infeasible", time.perf_counter() - started)
    if relaxed.status != 0:
        raise RuntimeError(f"LP relaxation failed: {relaxed.message}")
    lp_bound = max(0, math.ceil(P + relaxed.fun - 1e-6))
    if not integer:
        return Optimum(lp_bound, None, False, "lp", time.perf_counter() - started)
    solved = milp(objective, integrality=integrality, bounds=bounds, constraints=constraints,
                  options={"time_limit": float(time_limit)})
    seconds = time.perf_counter() - started
    if solved.x is None:
        if solved.status == 2:
            return Optimum(P + 1, None, False, "infeasible", seconds)
        return Optimum(lp_bound, None, False, "time limit", seconds)
    x = np.round(solved.x[:nx]).astype(np.int64).reshape(num_gpus, load.shape[0])
    row = _row_from(x, current, num_gpus)
    rewritten = int((row != current).sum())
    if solved.status == 0:
        return Optimum(rewritten, rewritten, True, "optimal", seconds, row)
    dual = getattr(solved, "mip_dual_bound", None)
    bound = lp_bound if dual is None or not np.isfinite(dual) else max(lp_bound, math.ceil(P + dual - 1e-6))
    return Optimum(bound, rewritten, False, "time limit", seconds, row)


def slack_bound(load: np.ndarray, current: np.ndarray, counts: np.ndarray, num_gpus: int, target: float,
                grid: int = 2000) -> int:
    """[E] load, [P] placement in force, [E] replica counts (each >= 1, summing to P), the busiest GPU's
    limit -> no placement with these counts and its busiest GPU at most `target` rewrites fewer slots.

    Why a second bound: at a tight target the LP relaxation fills every GPU to the limit with fractions
    of replicas, and whole replicas cannot. What every placement must respect instead: the GPUs'
    room under the limit, W * target - total load, is fixed by the counts, and a GPU that rewrites k
    of its slots ends with at least the room its k new replicas cannot fill. So, per GPU and per set
    of its slots rewritten, the least room left: its room with those slots emptied, less the heaviest
    one or two replicas of any expert that fit (none for no slot, nothing left for three or more:
    a relaxation); the sets whose room is negative are out. A dynamic program over the GPUs then
    finds the fewest slots rewritten whose rooms left add up to at most the total room, with at least
    as many slots rewritten among those of experts whose count falls as their counts fall. Rooms are
    rounded down to a grid of `grid` steps of the total room, so the program's answer stays a bound.

    Costs 2^S subsets per GPU: fine at the benchmark's 5 and 9 slots a GPU."""
    load = np.asarray(load, dtype=np.float64)
    current = np.asarray(current, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    P, W = current.shape[0], num_gpus
    S = P // W
    if counts.shape != load.shape or counts.min() < 1 or int(counts.sum()) != P or P % W:
        raise ValueError(f"replica counts must be >= 1 each and sum to the {P} slots, on GPUs of equal size")
    per_replica = load / counts
    held = np.bincount(current, minlength=load.shape[0])
    falling = held > counts  # experts that must lose slots
    must_free = int((held - counts)[falling].sum())
    slot_weight = per_replica[current].reshape(W, S)
    room = target * (1.0 + _TARGET_SLACK) - slot_weight.sum(axis=1)  # [W]
    total_room = W * target * (1.0 + _TARGET_SLACK) - load.sum()
    if total_room < 0:
        return P + 1
    singles = np.sort(per_replica)
    pairs = np.unique((singles[:, None] + singles[None, :])[np.triu_indices(singles.shape[0])])
    step = total_room / grid if total_room > 0 else 1.0
    subsets = np.array(list(itertools.product((0, 1), repeat=S)), dtype=bool)  # [2^S, S]
    sizes = subsets.sum(axis=1)
    INF = np.iinfo(np.int64).max // 4
    best = np.full((must_free + 1, grid + 1), INF, dtype=np.int64)  # [slots freed of falling experts, room left]
    best[0, 0] = 0
    for g in range(W):
        emptied = room[g] + subsets.astype(np.float64) @ slot_weight[g]  # [2^S]
        freed = np.minimum(must_free, subsets @ falling[current[g * S:(g + 1) * S]].astype(np.int64))
        left = np.where(sizes == 0, emptied, 0.0)
        for k, fills in ((1, singles), (2, pairs)):
            mask = sizes == k
            i = np.searchsorted(fills, emptied[mask], side="right") - 1
            left[mask] = np.where(i >= 0, emptied[mask] - fills[np.maximum(i, 0)], np.inf)
        ok = (emptied >= 0) & np.isfinite(left)
        steps = np.floor(np.where(ok, left, 0.0) / step).astype(np.int64)
        ok &= steps <= grid
        nxt = np.full_like(best, INF)
        for k, r, q in {(int(k), int(r), int(q)) for k, r, q in zip(sizes[ok], freed[ok], steps[ok])}:
            shifted = best[:, :grid + 1 - q] + k
            # freed slots beyond must_free count as must_free (the program needs at least that many)
            for r0 in range(must_free + 1):
                r1 = min(must_free, r0 + r)
                np.minimum(nxt[r1, q:], shifted[r0], out=nxt[r1, q:])
        best = nxt
    answer = int(best[must_free].min())
    return P + 1 if answer >= INF else answer
