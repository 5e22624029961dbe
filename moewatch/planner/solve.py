"""The planner's entry point: one call from a load to a placement and what it is worth.

`solve_placement` picks the method from what it is given:
- load only: balanced (replicas by water-filling, LPT packing, swaps), topology-aware with nodes;
- with `current`: the fewest expert moves whose balancedness is within `tolerance` of the
  balanced plan (movement.py);
- with `affinity` (transition counts): pairs between consecutive layers kept on a GPU under
  `balancedness_floor` (affinity.py); with `current` too, GPUs are renamed (all layers alike) to
  move as little as that allows;
- with `max_replicas`: a layer where the solve gives an expert more slots than that is re-packed
  from capped replica counts (and aligned to `current` when given);
- with unequal `rank_speed`: each rank's predicted time (load / speed) is balanced instead of its
  load (speed.py), from the plan above; equal speeds take the path above unchanged.
Decisions only: nothing here touches a runtime.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..plan import PlanError, check_placement
from .affinity import affinity_placement
from .placement_math import (PlacementShapeError, check_sizes, contiguous_placement, dispatch_cross_shares,
                             experts_moved, normalised_rank_speed, placement_balancedness,
                             placement_time_balancedness, replica_counts_of, transition_cross_shares)
from .movement import align_to_current, minimal_movement
from .packing import pack
from .replicate import capped_replica_counts, replica_counts
from .speed import (align_within_speed_groups, balance_time, replica_counts_fit, small_count_vectors,
                    time_lpt_pack, time_minimal_movement)


@dataclass(frozen=True)
class PlacementResult:
    """A solved placement and its figures; "before" is the placement in force, or the runtimes'
    contiguous default (slot s holds expert s mod E) when none was given."""

    physical_to_logical_map: np.ndarray  # [L, P]
    method: str  # "balanced", "movement" or "affinity"
    num_gpus: int
    num_nodes: int
    balancedness_before: np.ndarray  # [L]
    balancedness_after: np.ndarray  # [L]
    experts_moved: np.ndarray  # [L] slots whose expert changes
    bytes_moved: float | None  # experts moved x expert_bytes, when expert_bytes was given
    cross_gpu_share_before: np.ndarray  # [L] pairs leaving their rank (dispatch)
    cross_gpu_share_after: np.ndarray
    cross_node_share_before: np.ndarray  # [L] pairs leaving their node (dispatch)
    cross_node_share_after: np.ndarray
    transition_cross_gpu_before: float | None  # consecutive-layer pairs across GPUs (affinity)
    transition_cross_gpu_after: float | None
    transition_cross_node_before: float | None
    transition_cross_node_after: float | None
    solve_seconds: float
    layer_methods: tuple[str, ...] | None = None  # movement: "kept", "repaired" or "renamed"
    # [L] mean / max of per-rank load / speed; equal to balancedness without (or with equal) speeds
    time_balancedness_before: np.ndarray | None = None
    time_balancedness_after: np.ndarray | None = None
    rank_speed: np.ndarray | None = None  # [W] speeds normalised to mean 1, as given to the solve

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures: layer means, plus the worst layer's balancedness."""
        out: dict[str, Any] = {
            "method": self.method,
            "solve_seconds": self.solve_seconds,
            "num_layers": int(self.physical_to_logical_map.shape[0]),
            "num_slots": int(self.physical_to_logical_map.shape[1]),
            "num_gpus": self.num_gpus,
            "num_nodes": self.num_nodes,
            "balancedness_before": float(self.balancedness_before.mean()),
            "balancedness_after": float(self.balancedness_after.mean()),
            "balancedness_after_min": float(self.balancedness_after.min()),
            "time_balancedness_before": float(_or(self.time_balancedness_before, self.balancedness_before).mean()),
            "time_balancedness_after": float(_or(self.time_balancedness_after, self.balancedness_after).mean()),
            "experts_moved": int(self.experts_moved.sum()),
            "bytes_moved": self.bytes_moved,
            "layers_changed": int((self.experts_moved > 0).sum()),
            "cross_gpu_share_before": float(self.cross_gpu_share_before.mean()),
            "cross_gpu_share_after": float(self.cross_gpu_share_after.mean()),
            "cross_node_share_before": float(self.cross_node_share_before.mean()),
            "cross_node_share_after": float(self.cross_node_share_after.mean()),
        }
        if self.transition_cross_gpu_after is not None:
            out.update(
                transition_cross_gpu_share_before=self.transition_cross_gpu_before,
                transition_cross_gpu_share_after=self.transition_cross_gpu_after,
                transition_cross_node_share_before=self.transition_cross_node_before,
                transition_cross_node_share_after=self.transition_cross_node_after,
            )
        if self.rank_speed is not None:
            out["rank_speed"] = [float(v) for v in self.rank_speed]
        if self.layer_methods is not None:
            out["layer_methods"] = {name: self.layer_methods.count(name) for name in ("kept", "repaired", "renamed")}
        return out


def solve_placement(load: Any, num_gpus: int, num_slots: int | None = None, num_nodes: int = 1,
                    current: Any = None, affinity: Any = None, balancedness_floor: float = 0.95,
                    expert_bytes: float | None = None, tolerance: float = 0.005,
                    max_replicas: int | None = None, rank_speed: Any = None) -> PlacementResult:
    """[L, E] pairs per expert -> PlacementResult with physical_to_logical_map [L, P].

    num_slots defaults to the current plan's P, else E rounded up to a multiple of num_gpus (no
    extra memory). current: [L, P] placement in force. affinity: [L-1, E, E] transition counts
    (affinity.transitions_from_trace turns a [T, L, k] trace into them). max_replicas: most slots one
    expert may hold (None: no cap; the cap rises to ceil(P / E) where the slots need it). Raises
    PlacementShapeError naming the argument at fault. rank_speed: [W] positive speeds (any scale,
    e.g. pairs per second): balance each rank's time, load / speed, instead of its load; None or
    all equal gives exactly the speed-oblivious plan.
    """
    load_arr = _load_matrix(load)
    L, E = load_arr.shape
    W, N = int(num_gpus), int(num_nodes)
    current_arr = None if current is None else _placement(current, L, E)
    if num_slots is None:
        num_slots = current_arr.shape[1] if current_arr is not None else -(-E // max(W, 1)) * max(W, 1)
    P = int(num_slots)
    check_sizes(E, P, W, N)
    if current_arr is not None and current_arr.shape[1] != P:
        raise PlacementShapeError("current", f"{current_arr.shape[1]} slots, but {P} asked for")
    transitions = None if affinity is None else _transitions(affinity, L, E)
    if not 0.0 < balancedness_floor <= 1.0:
        raise PlacementShapeError("balancedness_floor", f"must be in (0, 1], got {balancedness_floor}")
    if not 0.0 <= tolerance < 1.0:
        raise PlacementShapeError("tolerance", f"must be in [0, 1), got {tolerance}")
    if max_replicas is not None and max_replicas < 1:
        raise PlacementShapeError("max_replicas", f"must be at least 1, got {max_replicas}")
    speed = None if rank_speed is None else normalised_rank_speed(rank_speed, W)
    uneven = speed is not None and not np.all(speed == 1.0)
    if uneven and transitions is not None:
        raise PlacementShapeError("rank_speed", "unequal speeds cannot be combined with affinity yet")

    started = time.perf_counter()
    scratch = no_worse_than_least_replication(load_arr, pack(load_arr, replica_counts(load_arr, P), W, N), W, N)
    layer_methods = None
    if uneven:
        method, pmap, layer_methods = _solve_for_speeds(load_arr, scratch, current_arr, speed, W, N, tolerance,
                                                        max_replicas)
    elif transitions is not None:
        method = "affinity"
        pmap = affinity_placement(load_arr, transitions, scratch, W, N, balancedness_floor)
        if current_arr is not None:
            pmap = align_to_current(pmap, current_arr, W, N, per_layer=False)
    elif current_arr is not None:
        method = "movement"
        pmap, facts = minimal_movement(load_arr, current_arr, scratch, W, N, tolerance)
        layer_methods = tuple(facts["how"])
    else:
        method = "balanced"
        pmap = scratch
    if max_replicas is not None and not uneven:
        pmap = _cap_replicas(load_arr, pmap, current_arr, W, N, max_replicas)
    solve_seconds = time.perf_counter() - started

    before = current_arr if current_arr is not None else contiguous_placement(L, E, P)
    gpu_before, node_before = dispatch_cross_shares(load_arr, before, W, N)
    gpu_after, node_after = dispatch_cross_shares(load_arr, pmap, W, N)
    moved = experts_moved(before, pmap)
    trans_before = trans_after = (None, None)
    if transitions is not None:
        trans_before = transition_cross_shares(transitions, before, W, N)
        trans_after = transition_cross_shares(transitions, pmap, W, N)
    balancedness_before = placement_balancedness(load_arr, before, W)
    balancedness_after = placement_balancedness(load_arr, pmap, W)
    if uneven:
        time_before = placement_time_balancedness(load_arr, before, speed)
        time_after = placement_time_balancedness(load_arr, pmap, speed)
    else:  # equal speeds: every time is the load over one constant, the same ratio
        time_before, time_after = balancedness_before.copy(), balancedness_after.copy()
    return PlacementResult(
        physical_to_logical_map=pmap,
        method=method,
        num_gpus=W,
        num_nodes=N,
        balancedness_before=balancedness_before,
        balancedness_after=balancedness_after,
        experts_moved=moved,
        bytes_moved=None if expert_bytes is None else float(moved.sum()) * float(expert_bytes),
        cross_gpu_share_before=gpu_before,
        cross_gpu_share_after=gpu_after,
        cross_node_share_before=node_before,
        cross_node_share_after=node_after,
        transition_cross_gpu_before=trans_before[0],
        transition_cross_gpu_after=trans_after[0],
        transition_cross_node_before=trans_before[1],
        transition_cross_node_after=trans_after[1],
        solve_seconds=solve_seconds,
        layer_methods=layer_methods,
        time_balancedness_before=time_before,
        time_balancedness_after=time_after,
        rank_speed=speed,
    )


def _or(value: np.ndarray | None, default: np.ndarray) -> np.ndarray:
    return default if value is None else value


def _solve_for_speeds(load: np.ndarray, scratch: np.ndarray, current: np.ndarray | None, speed: np.ndarray,
                      num_gpus: int, num_nodes: int, tolerance: float,
                      max_replicas: int | None) -> tuple[str, np.ndarray, tuple[str, ...] | None]:
    """The speed-aware plan: the local search of speed.py from the speed-oblivious plan and from a
    heaviest-to-fastest packing, keeping the better per layer; with `current`, the fewest moves
    whose busiest time is within `tolerance` of it. Returns (method, [L, P] plan, layer methods)."""
    L, E = load.shape
    P = scratch.shape[1]
    cap = None if max_replicas is None else max(max_replicas, math.ceil(P / E))
    if max_replicas is not None:
        scratch = _cap_replicas(load, scratch, None, num_gpus, num_nodes, max_replicas)
    # Heaviest-to-fastest seeds with all slots as replicas, and with fewer replicas and the rest as
    # padding: a slow rank can only shed load by holding fewer distinct experts, and a search from
    # a full plan must pass through plateaus to get there.
    seeds = []
    for replicas in sorted({P, E, (P + E) // 2}, reverse=True):
        counts = replica_counts(load, replicas) if cap is None else capped_replica_counts(load, replicas, max_replicas)
        seeds.append(time_lpt_pack(load, counts, speed, P))
    # Small layers: a seed for every replica-count vector (a handful; see small_count_vectors).
    vectors = small_count_vectors(E, P, num_gpus) if E * P <= 64 else None
    for vector in [] if vectors is None else vectors:
        if cap is None or vector.max() <= cap:
            seeds.append(time_lpt_pack(load, np.broadcast_to(vector, (L, E)), speed, P))
    timed = balance_time(load, [scratch, *seeds], speed, cap)
    if current is None:
        return "balanced", timed, None
    pmap, facts = time_minimal_movement(load, current, timed, speed, tolerance, cap)
    over = ~replica_counts_fit(pmap, E, cap)  # a kept layer in force may give an expert too many slots
    if over.any():
        pmap[over] = align_within_speed_groups(timed[over], current[over], speed)
        for layer in np.flatnonzero(over):
            facts["how"][layer] = "renamed"
    return "movement", pmap, tuple(facts["how"])


def _cap_replicas(load: np.ndarray, pmap: np.ndarray, current: np.ndarray | None, num_gpus: int, num_nodes: int,
                  max_replicas: int) -> np.ndarray:
    """[L, P] placement with every layer that gives an expert more than max_replicas slots re-packed
    from capped replica counts, aligned to `current` [L, P] when given."""
    over = np.flatnonzero(replica_counts_of(pmap, load.shape[1]).max(axis=1) > max_replicas)
    if not over.size:
        return pmap
    pmap = np.array(pmap)
    counts = capped_replica_counts(load[over], pmap.shape[1], max_replicas)
    repacked = pack(load[over], counts, num_gpus, num_nodes)
    if current is not None:
        repacked = align_to_current(repacked, current[over], num_gpus, num_nodes)
    pmap[over] = repacked
    return pmap


def no_worse_than_least_replication(load: np.ndarray, pmap: np.ndarray, num_gpus: int,
                                    num_nodes: int = 1) -> np.ndarray:
    """[L, E] load, [L, P] balanced placement -> [L, P] placement that, in every layer, is as
    balanced as the plan with the fewest slots (P0 = E rounded up to a multiple of W: no
    replication when W divides E), solved by the same method, wherever that plan embeds.

    That plan fits in P slots with the same per-GPU loads when every GPU holds an expert whose only
    replica is there: its extra slots repeat that expert. Always so without replication (W divides
    E). Where a GPU has none, a slot-by-slot local search stands in; it is not exact (a random
    search of 67,642 small problems found 4 where it fell short of the least plan, by at most
    0.0012 balancedness). It is solved only for layers where it could win: no packing of its replicas beats
    mean / max(mean GPU load, heaviest replica). Greedy replica counts are not always the best for
    packing (a second replica that cannot share a GPU with the first may land on a busy one), so
    without this step more slots could give a worse plan."""
    L, E = load.shape
    W = num_gpus
    P = pmap.shape[1]
    P0 = -(-E // W) * W
    if P0 == P:
        return pmap
    ours = placement_balancedness(load, pmap, W)
    mean = load.sum(axis=1) / W
    counts0 = replica_counts(load, P0)
    heaviest = (load / counts0).max(axis=1)
    ceiling = np.divide(mean, np.maximum(mean, heaviest), out=np.ones(L), where=mean > 0)
    layers = np.flatnonzero(ours < ceiling)
    if layers.size == 0:
        return pmap
    sub = load[layers]
    least = pack(sub, counts0[layers], W, num_nodes)
    embedded = _embed(least, E, W, P)
    least_bal = placement_balancedness(sub, least, W)
    out = pmap.copy()
    for i, layer in enumerate(layers):
        if embedded[i] is not None and placement_balancedness(sub[i:i + 1], embedded[i][None], W)[0] > ours[layer]:
            out[layer] = embedded[i]
        elif embedded[i] is None and least_bal[i] > ours[layer]:
            # No exact embedding (a GPU holds no expert of its own): search slot by slot instead,
            # from the least plan grown to P slots and from our plan, and keep the better.
            grown = _refine_slots(sub[i], _grow(least[i], W, P), W)
            refined = _refine_slots(sub[i], pmap[layer], W)
            best = max((grown, refined, pmap[layer]),
                       key=lambda row: placement_balancedness(sub[i:i + 1], row[None], W)[0])
            out[layer] = best
    return out


def _slot_gpu_load(load_row: np.ndarray, row: np.ndarray, num_gpus: int) -> np.ndarray:
    """[E] load, [P] placement -> [W] load per GPU, each expert's load split over its replicas."""
    counts = np.bincount(row, minlength=load_row.shape[0])
    return (load_row[row] / counts[row]).reshape(num_gpus, -1).sum(axis=1)


def _grow(row0: np.ndarray, num_gpus: int, num_slots: int) -> np.ndarray:
    """[P0] placement -> [P]: each GPU's extra slots repeat its first slot's expert (a start for
    `_refine_slots`, which moves them where they help)."""
    bins = row0.reshape(num_gpus, -1)
    extra = np.repeat(bins[:, :1], num_slots // num_gpus - bins.shape[1], axis=1)
    return np.concatenate([bins, extra], axis=1).ravel()


def _refine_slots(load_row: np.ndarray, row: np.ndarray, num_gpus: int, max_rounds: int = 200) -> np.ndarray:
    """[E] load, [P] placement -> [P]: while it lowers the busiest GPU's load, give one of that GPU's
    slots to another expert, or swap it with a slot elsewhere (every expert keeps a replica)."""
    row = row.copy()
    E, P = load_row.shape[0], row.shape[0]
    S = P // num_gpus
    peak = _slot_gpu_load(load_row, row, num_gpus).max()
    for _ in range(max_rounds):
        g = int(np.argmax(_slot_gpu_load(load_row, row, num_gpus)))
        counts = np.bincount(row, minlength=E)
        best = None
        for s in range(g * S, (g + 1) * S):
            candidates = [("set", s, f) for f in range(E) if f != row[s] and counts[row[s]] > 1]
            candidates += [("swap", s, t) for t in range(P) if t // S != g and row[t] != row[s]]
            for kind, a, b in candidates:
                trial = row.copy()
                if kind == "set":
                    trial[a] = b
                else:
                    trial[a], trial[b] = trial[b], trial[a]
                value = _slot_gpu_load(load_row, trial, num_gpus).max()
                if value < peak - 1e-12 * max(peak, 1.0):
                    peak, best = value, trial
        if best is None:
            return row
        row = best
    return row


def _embed(least: np.ndarray, num_experts: int, num_gpus: int, num_slots: int) -> list[np.ndarray | None]:
    """[A, P0] placements -> each as [P] with every GPU's extra slots repeating one of its own
    single-replica experts (None where a GPU has none)."""
    A, P0 = least.shape
    S0, S = P0 // num_gpus, num_slots // num_gpus
    out: list[np.ndarray | None] = []
    for row in least:
        counts = np.bincount(row, minlength=num_experts)
        bins = row.reshape(num_gpus, S0)
        alone = counts[bins] == 1
        if not alone.any(axis=1).all():
            out.append(None)
            continue
        pick = bins[np.arange(num_gpus), np.argmax(alone, axis=1)]
        extra = np.repeat(pick[:, None], S - S0, axis=1)
        out.append(np.concatenate([bins, extra], axis=1).ravel())
    return out


def _load_matrix(load: Any) -> np.ndarray:
    try:
        arr = np.asarray(load, dtype=np.float64)
    except (TypeError, ValueError):
        raise PlacementShapeError("load", "expected a numeric [layers][experts] matrix") from None
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise PlacementShapeError("load", f"expected a non-empty [layers][experts] matrix, got shape {list(arr.shape)}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise PlacementShapeError("load", "counts must be finite and >= 0")
    return arr


def _placement(current: Any, num_layers: int, num_experts: int) -> np.ndarray:
    try:
        arr = np.asarray(current)
    except ValueError:
        raise PlacementShapeError("current", "ragged nested list") from None
    if arr.ndim != 2 or arr.shape[0] != num_layers or arr.dtype.kind not in "iu":
        raise PlacementShapeError("current", f"expected an integer [{num_layers}][slots] map, got shape "
                                             f"{list(arr.shape)} ({arr.dtype})")
    arr = arr.astype(np.int64)
    try:
        check_placement(arr, num_experts)
    except PlanError as exc:
        raise PlacementShapeError("current", str(exc)) from None
    return arr


def _transitions(affinity: Any, num_layers: int, num_experts: int) -> np.ndarray:
    arr = np.asarray(affinity, dtype=np.float64)
    if arr.shape != (max(num_layers - 1, 0), num_experts, num_experts):
        raise PlacementShapeError("affinity", f"expected transitions [{num_layers - 1}, {num_experts}, "
                                              f"{num_experts}], got {list(arr.shape)}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise PlacementShapeError("affinity", "counts must be finite and >= 0")
    return arr
