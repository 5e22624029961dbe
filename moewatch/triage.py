"""The documented triage order ([a2a-bottleneck], "observable signals and fault location"), per layer.

1. All-to-all share of layer time: at or above `comm_share`, communication dominates. The share is
   the transfer only: a synchronous all-to-all ends for all ranks when the last has arrived, so the
   rank that arrives last spends only the transfer and what the others spend beyond it is waiting
   (telemetry.a2a_transfer_seconds; measured waits when the window carries `wait_seconds`). Waiting
   is evidence for step 2: a rank that arrives late at even load is a straggler.
2. Dispersion of per-rank load (std/mean, max/mean): large means load imbalance (with time
   balancedness beside it: a plan made for a slow rank lowers plain balancedness on purpose). At
   even load, a rank slower than the others (its compute time, or its speed over the whole window,
   or the others' wait for it) is a straggler.
3. Cross-rank ratio against what the placement predicts: well above it means the expert-to-rank
   mapping drives the traffic; at the prediction, the traffic is the inherent volume.

Verdicts and causes:
- imbalance-bound / hot-experts: ranks imbalanced and a few experts carry the load.
- imbalance-bound / straggler: ranks imbalanced without hot experts (the packing puts too much on
  one rank), or, at even load, one rank's expert compute is much slower per pair (a slow device;
  per pair, since compute time grows with the pairs a busier rank carries), or the others wait
  `straggler_wait_share` of layer time for one rank that arrives last. A transfer-dominated layer
  with a slow rank is read as the straggler when the window's median layer is not
  transfer-dominated (the rank's stalls inside the all-to-all), the communication cause going to
  `metrics.other_reading` (docs/triage.md, "A CPU-starved rank").
- comm-bound / small-batch: balanced, comm-dominated, messages under the seed's 32 KB.
- comm-bound / placement: balanced, comm-dominated, cross-rank ratio above the prediction.
- comm-bound / volume: balanced, comm-dominated, traffic as the placement predicts; when the window
  carries the all-to-all's bound (known link rates) and the time is far above it, the order of the
  exchange is to blame too: action `schedule` (Aurora's rounds).
- healthy otherwise. `overflow` is a flag on top of any verdict.

Every predicted gain is the share of the layer's per-step time an action is expected to remove,
estimated from this window alone (the planner's cost model refines it). Pure functions of a Window.

Absent evidence (a source that cannot measure timings or rank-level counts): a step whose evidence
is missing is reported as unknown, in the evidence and as null metrics; the verdict comes from the
steps that have evidence, and each layer lists what was missing (`missing`, EVIDENCE kinds). With
no rank-level counts, step 2 falls back on the one dispersion every window has, the expert load's.
An action whose gain needs an unmeasured number carries `predicted_gain` None, never an estimate.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import slo as slo_signals
from . import telemetry as tm
from . import topology
from .capacity import mean_load_capacities, mean_load_overflow_rates, round_up_capacity
from .telemetry import Window
from .thresholds import Thresholds

from .vocabulary import ACTION_KINDS, CAUSES, COMM_BOUND, HEALTHY, IMBALANCE_BOUND, VERDICTS  # noqa: F401


@dataclass(frozen=True)
class Action:
    kind: str  # one of ACTION_KINDS
    predicted_gain: float | None  # share of the layer's per-step time removed, in [0, 1); None: unknown
    summary: str  # one sentence for an operator
    params: dict[str, Any] = field(default_factory=dict)  # experts, value, ...

    def to_dict(self) -> dict[str, Any]:
        gain = None if self.predicted_gain is None else round(self.predicted_gain, 4)
        return {"kind": self.kind, "predicted_gain": gain, "summary": self.summary, **self.params}


@dataclass(frozen=True)
class LayerDiagnosis:
    layer: int
    verdict: str
    cause: str | None
    overflow: bool
    metrics: dict[str, Any]
    evidence: list[str]
    actions: list[Action]
    # Seconds per step this layer could save with its best action: the ranking key (NaN: unknown).
    seconds_at_stake: float
    # Evidence kinds (telemetry.EVIDENCE) the window lacked: their triage steps are unknown.
    missing: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "verdict": self.verdict, "cause": self.cause, "overflow": self.overflow,
                "seconds_at_stake": _finite(self.seconds_at_stake), "missing": self.missing,
                "metrics": self.metrics, "evidence": self.evidence, "actions": [a.to_dict() for a in self.actions]}


@dataclass(frozen=True)
class WindowDiagnosis:
    identity: dict[str, Any]
    layers: list[LayerDiagnosis]  # in layer order
    summary: dict[str, Any]

    def worst_first(self) -> list[LayerDiagnosis]:
        return sorted(self.layers, key=_severity_key)

    def to_dict(self) -> dict[str, Any]:
        return {**self.identity, "summary": self.summary, "layers": [d.to_dict() for d in self.layers]}


def _severity_key(d: LayerDiagnosis) -> tuple:
    stake = d.seconds_at_stake if math.isfinite(d.seconds_at_stake) else 0.0
    return (d.verdict == HEALTHY, not d.overflow, -stake, d.layer)


def _finite(x: Any) -> Any:
    """JSON-safe number: non-finite becomes None."""
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


# --- load-shape estimates behind the predicted gains ------------------------------------------
# Vectorised over rows (one row per layer, or per layer and action), so a window of 58 layers costs
# a few dozen numpy calls, not tens of thousands. Each equals, row by row, the one-row greedy it is
# named after (tests/core/test_triage_vectorised.py keeps the loops as the reference).

def pack_max_loads(items: np.ndarray, num_ranks: int, slots_per_rank: np.ndarray | int) -> np.ndarray:
    """[R, n] item loads -> [R] busiest rank's load after greedy packing, per row: heaviest item to
    the least-loaded rank with a free slot (the lowest index among equals). slots_per_rank: [R] or
    one int; each row needs n <= num_ranks * slots_per_rank (zero items may pad a row).

    Exactly the sequential greedy, in batches: after sorting the open ranks by (load, index), the next
    items go to them in that order for as long as each stays the least loaded; the batch stops at the
    first item whose turn is not certain (a tie included), and the next batch sorts again. When a
    handful of open ranks share what is left (a batch places a few items), the rest go one item per
    step (`_place_one_by_one`). Zero items come last and change no load, so they are never placed."""
    x = np.sort(np.asarray(items, dtype=np.float64), axis=1)[:, ::-1]
    R, n = x.shape
    W = int(num_ranks)
    todo = (x > 0).sum(axis=1)
    x = np.concatenate([x, np.zeros((R, W))], axis=1)  # a batch never reads past a row's end
    # The first batch needs no sort: with every rank empty, the first W items go to ranks 0..W-1.
    loads = np.where(x[:, :W] > 0, x[:, :W], 0.0)
    free = np.repeat(np.broadcast_to(np.asarray(slots_per_rank, dtype=np.int64), (R,))[:, None], W, axis=1)
    free -= loads > 0
    ptr = np.minimum(todo, W)
    cols = np.arange(W)
    active = np.flatnonzero(ptr < todo)
    while active.size:
        # Plain fancy indexing (rows x order) rather than take/put_along_axis: the same elements,
        # without rebuilding the index grids on every batch.
        rows = active[:, None]
        load, slots, at = loads[active], free[active], ptr[active]
        key = np.where(slots > 0, load, np.inf)
        order = np.argsort(key, axis=1, kind="stable")
        local = np.arange(len(active))[:, None]
        key_sorted = key[local, order]  # full ranks last, at inf
        slots_sorted = slots[local, order]
        after = key_sorted + x[rows, at[:, None] + cols[None, :]]
        # Item j goes to the j-th open rank if that rank is lighter than every rank given an item
        # earlier in the batch (and still open); equal is not certain (the index decides): stop.
        rivals = np.minimum.accumulate(np.where(slots_sorted > 1, after, np.inf), axis=1)
        ok = np.ones(after.shape, dtype=bool)
        ok[:, 1:] = key_sorted[:, 1:] < rivals[:, :-1]
        ok &= np.isfinite(key_sorted) & (cols[None, :] < (todo[active] - at)[:, None])
        taken = np.logical_and.accumulate(ok, axis=1)
        loads[rows, order] = np.where(taken, after, load[local, order])
        free[rows, order] = slots_sorted - taken
        placed = taken.sum(axis=1)
        ptr[active] = at + placed
        going = ptr[active] < todo[active]
        active, placed = active[going], placed[going]
        left = todo[active] - ptr[active]
        # One step costs a small part of a batch: step once the batches left would outnumber the
        # steps left by BATCH_OVER_STEP (a batch still places many items when it is ahead).
        if active.size and left.max() < BATCH_OVER_STEP * (-(-left // np.maximum(placed, 1))).max():
            _place_one_by_one(x, loads, free, ptr, todo, active)
            break
    return loads.max(axis=1)


BATCH_OVER_STEP = 24  # CPU of one batch over one item step, about (a DeepSeek-V3-size window's 174 rows)


def _place_one_by_one(x: np.ndarray, loads: np.ndarray, free: np.ndarray, ptr: np.ndarray, todo: np.ndarray,
                      rows: np.ndarray) -> None:
    """The sequential greedy of `pack_max_loads` for `rows`, one item per step for all of them at
    once: each row's next item to its least-loaded open rank (argmin: the lowest index among
    equals). x: [R, n + W] sorted items, loads/free: [R, W], ptr/todo: [R]; loads is updated."""
    W = loads.shape[1]
    at, end = ptr[rows], todo[rows]
    steps = int((end - at).max())
    index = at[:, None] + np.arange(steps)
    counted = index < end[:, None]  # a row whose items ran out takes zeros and uses no slot
    values = np.where(counted, x[rows[:, None], np.minimum(index, x.shape[1] - 1)], 0.0)
    used = counted.astype(np.int64)
    load, slots = loads[rows], free[rows]
    key = np.where(slots > 0, load, np.inf)
    flat_load, flat_slots, flat_key = load.reshape(-1), slots.reshape(-1), key.reshape(-1)
    base = np.arange(len(rows)) * W
    for step in range(steps):
        flat = base + key.argmin(axis=1)
        new = flat_load.take(flat) + values[:, step]
        flat_load.put(flat, new)
        left = flat_slots.take(flat) - used[:, step]
        flat_slots.put(flat, left)
        flat_key.put(flat, np.where(left > 0, new, np.inf))
    loads[rows] = load


def replica_splits(expert_load: np.ndarray, hot: np.ndarray, extra_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Slot loads after giving extra_slots[r] replicas to row r's experts hot[r] (-1 pads), one at a
    time to whichever of them has the most load per replica (the first listed among equals).
    expert_load: [R, E], hot: [R, H], extra_slots: [R] -> ([R, E + max(extra)] slot loads, zero
    padded; [R] slots used = E + extra)."""
    load = np.asarray(expert_load, dtype=np.float64)
    R, E = load.shape
    extra = np.asarray(extra_slots, dtype=np.int64)
    valid = hot >= 0
    rows = np.arange(R)[:, None]
    hot_load = np.where(valid, load[rows, np.maximum(hot, 0)], -np.inf)
    reps = valid.astype(np.int64)
    for k in range(int(extra.max(initial=0))):
        live = np.flatnonzero(k < extra)
        best = np.argmax(hot_load[live] / np.maximum(reps[live], 1), axis=1)
        reps[live, best] += 1
    counts = np.ones((R, E), dtype=np.int64)
    counts[np.nonzero(valid)[0], hot[valid]] = reps[valid]
    used = counts.sum(axis=1)
    values = np.repeat((load / counts).ravel(), counts.ravel())
    row_of = np.repeat(np.arange(R), used)
    offset = np.arange(values.size) - np.repeat(np.cumsum(used) - used, used)
    out = np.zeros((R, int(used.max(initial=E))))
    out[row_of, offset] = values
    return out, used


@dataclass(frozen=True)
class Predictions:
    """What the actions' gains rest on, for every layer of a window at once (NaN where not wanted
    or not measurable): the busiest rank's load after each action, and the capacity factors."""

    replicate_experts: list[list[int]]  # per layer, the experts `replicate` names
    replicate_extra: np.ndarray  # [L] extra slots it asks for
    replicate_max_load: np.ndarray  # [L]
    placement_max_load: np.ndarray  # [L] re-packing the measured slot loads
    capacity: np.ndarray  # [L] capacity factor for the overflow target, rounded up
    cap_max_load: np.ndarray  # [L] after capping experts at `capacity` (lossy)
    cap_overflow: np.ndarray  # [L] overflow share that cap costs


def predict(w: Window, metrics: list[dict[str, Any]], t: Thresholds, layers: np.ndarray | None = None
            ) -> Predictions:
    """The load-shape estimates for `layers` (default every layer), in one batched greedy packing.
    Without measured rank load there is nothing to compare an estimate with: loads are NaN."""
    L, E, W, spr = w.num_layers, w.num_experts, w.world_size, w.slots_per_rank
    layers = np.arange(L) if layers is None else np.asarray(layers, dtype=np.int64)
    if w.expert_tokens is None:
        # Per-rank totals only: no expert to replicate, no load to re-pack or cap.
        nan = np.full(L, np.nan)
        return Predictions([[] for _ in range(L)], np.zeros(L, dtype=np.int64), nan, nan, nan, nan, nan)
    expert_load = tm.kept_tokens(w).astype(np.float64)
    routed = w.expert_tokens
    hot_lists = [[] for _ in range(L)]
    for layer in layers:
        hot_lists[layer] = metrics[layer]["hot_experts"] or [
            int(e) for e in np.argsort(-expert_load[layer], kind="stable")[:max(1, W // 2)]]
    extra = np.array([max(len(h), W // 2) for h in hot_lists], dtype=np.int64)
    capacity = round_up_capacity(mean_load_capacities(routed, t.overflow_target))
    nan = np.full(L, np.nan)
    rep_max, place_max, cap_max, cap_overflow = nan.copy(), nan.copy(), nan.copy(), nan.copy()
    if len(layers) and tm.rank_load(w) is not None:
        width = max((len(hot_lists[layer]) for layer in layers), default=1)
        hot = np.full((len(layers), width), -1, dtype=np.int64)
        for i, layer in enumerate(layers):
            hot[i, :len(hot_lists[layer])] = hot_lists[layer]
        split, _ = replica_splits(expert_load[layers], hot, extra[layers])
        groups = [(split, spr + -(-extra[layers] // W), rep_max, layers)]
        if w.slot_tokens is not None:
            groups.append((w.slot_tokens[layers].astype(np.float64), np.full(len(layers), spr), place_max, layers))
        capped_layers = layers[capacity[layers] > 0]
        if capped_layers.size:
            mean = routed[capped_layers].mean(axis=1)
            capped = np.minimum(routed[capped_layers], (capacity[capped_layers] * mean)[:, None])
            groups.append((capped, np.full(len(capped_layers), spr), cap_max, capped_layers))
            cap_overflow[capped_layers] = mean_load_overflow_rates(routed[capped_layers], capacity[capped_layers])
        width = max(g[0].shape[1] for g in groups)
        items = np.concatenate([np.pad(g[0], ((0, 0), (0, width - g[0].shape[1]))) for g in groups])
        result = pack_max_loads(items, W, np.concatenate([g[1] for g in groups]))
        at = 0
        for rows, _, target, where in groups:
            target[where] = result[at:at + len(rows)]
            at += len(rows)
    return Predictions(hot_lists, extra, rep_max, place_max, capacity, cap_max, cap_overflow)


# --- the triage --------------------------------------------------------------------------------

# Why each evidence kind is missing, in words: the fields a source would have to carry.
_NEEDS = {kind: " or ".join(" + ".join(opt) for opt in options) for kind, options in tm.EVIDENCE.items()}


def unknown_text(what: str, kind: str) -> str:
    """One evidence line for a triage step the window cannot support."""
    return f"{what}: unknown (the window does not carry {_NEEDS[kind]})."


def layer_metrics(w: Window, t: Thresholds) -> list[dict[str, Any]]:
    """The numbers behind each layer's verdict, JSON-ready (per-step values divide by w.steps).
    A number the window cannot support is None (null in JSON), never an estimate."""
    steps = max(w.steps, 1)
    load = tm.rank_load(w)
    bound = tm.a2a_lower_bound_seconds(w, t.link_bandwidth_bytes_per_second)
    measured = tm.a2a_measured_seconds(w)
    a2a = tm.a2a_seconds(w)
    cols = {
        "a2a_share": tm.a2a_share(w),
        "a2a_transfer_share": tm.a2a_transfer_share(w),
        "a2a_wait_share": tm.a2a_wait_share(w),
        "rank_load_max_min": tm.rank_load_max_min(w),
        "rank_load_max_mean": tm.rank_load_max_mean(w),
        "rank_load_cv": tm.rank_load_cv(w),
        "balancedness": tm.balancedness(w),
        "expert_load_cv": tm.expert_load_cv(w),
        "cross_rank_ratio": tm.cross_rank_ratio(w),
        "expected_cross_rank_ratio": tm.expected_cross_rank_ratio(w),
        "overflow_rate": tm.overflow_rate(w),
        "effective_capacity_factor": tm.effective_capacity_factor(w),
        "a2a_efficiency": tm.a2a_efficiency(w, t.link_bandwidth_bytes_per_second),
        "a2a_lower_bound_seconds_per_step": None if bound is None else bound / steps,
        "a2a_seconds_per_step": None if measured is None else measured / steps,
        # From the window only (the source knew its link rates): absent, never guessed from a threshold.
        "a2a_bound_seconds_per_step": None if w.a2a_bound_seconds is None else w.a2a_bound_seconds / steps,
        "a2a_over_bound": w.a2a_over_bound,
        "dispatch_seconds_per_step": tm.per_step_max(w, "dispatch_seconds"),
        "combine_seconds_per_step": tm.per_step_max(w, "combine_seconds"),
        "compute_seconds_per_step": tm.per_step_max(w, "compute_seconds"),
        "layer_seconds_per_step": tm.per_step_max(w, "layer_seconds"),
        "compute_max_mean": tm.compute_max_mean(w),
        "time_balancedness": tm.time_balancedness(w),
        "mean_message_bytes": tm.mean_message_bytes(w),
        "capacity_factor": w.capacity_factor,
    }
    pair_time = tm.pair_seconds_relative(w)
    if pair_time is not None:
        # Only a rank the others wait for can straggle: one at or over the median rank's compute time.
        # A lightly loaded rank carries its fixed per-expert costs over fewer pairs and reads slow per
        # pair while it finishes first.
        compute = w.compute_seconds
        pair_time = np.where(compute >= np.median(compute, axis=1, keepdims=True), pair_time, np.nan)
    relative = tm.relative_rank_speed(w)
    slow_rank = None if relative is None else int(np.nanargmin(relative))
    slow_speed = None if relative is None else float(relative[slow_rank])
    hot = tm.hot_experts(w, t.hot_expert_multiple)
    # Groups that span nodes: the share of pairs over the slower inter-node link (topology.py).
    cross_node = topology.cross_node_ratio(w.traffic, w.world_size, w.ranks_per_node, w.num_layers)
    expected_node = (None if w.expert_tokens is None else
                     topology.expected_cross_node_ratio(w.expert_tokens, w.physical_to_logical_map, w.world_size,
                                                        w.ranks_per_node))
    L = w.num_layers
    # Each column converted once for all layers (a window of 58 layers is 20 columns, not 1,160 cells).
    columns = {name: _finite_column(col, L) for name, col in cols.items()}
    per_layer = {
        "routed_pairs": _int_column(w.expert_tokens, L),
        "dropped_pairs": _int_column(w.dropped_tokens, L),
        "rerouted_pairs": _int_column(w.rerouted_tokens, L),
        "rank_load": [None] * L if load is None else np.asarray(load).astype(np.int64).tolist(),
        "busiest_rank": [None] * L if load is None else np.argmax(load, axis=1).tolist(),
        # The rank the others wait for: the least time inside the all-to-all (it arrived last).
        "last_arriving_rank": [None] * L if a2a is None else np.argmin(a2a, axis=1).tolist(),
        "slowest_compute_rank": [None] * L if w.compute_seconds is None else np.argmax(w.compute_seconds, axis=1).tolist(),
        # Per pair (load taken out): the most compute seconds per pair over the median rank's, among the
        # ranks at or over the median compute time, and whose.
        "compute_per_pair_max_median": [None] * L if pair_time is None else _nanmax_rows(pair_time),
        "slowest_per_pair_rank": [None] * L if pair_time is None else _nanargmax_rows(pair_time),
        # The verdict the evidence also supports, where a transfer-dominated layer has a slow rank
        # (set by the triage: {"verdict", "cause"}); None otherwise.
        "other_reading": [None] * L,
        # Window-wide (a device is slow in every layer): the slowest rank and its speed over the median's.
        "slow_rank": [slow_rank] * L,
        "slow_rank_relative_speed": [slow_speed] * L,
        # Whether that rank's compute in this layer is at or over the median rank's: only then do the
        # others wait for its compute here (a rank slow per pair only from fixed costs over few pairs
        # finishes first).
        "slow_rank_holds_up": ([None] * L if slow_rank is None else
                               (w.compute_seconds[:, slow_rank] >= np.median(w.compute_seconds, axis=1)).tolist()),
        "hot_experts": [None] * L if hot is None else hot,
        "cross_node_ratio": _finite_column(cross_node, L),
        "expected_cross_node_ratio": _finite_column(expected_node, L),
    }
    out = []
    for layer in range(L):
        row = {name: values[layer] for name, values in columns.items()}
        row.update({name: values[layer] for name, values in per_layer.items()})
        out.append(row)
    return out


def _nanmax_rows(values: np.ndarray) -> list[float | None]:
    """[L, W] with NaN for unknown -> per row the largest known value (None where none is known)."""
    known = np.isfinite(values)
    top = np.where(known, values, -np.inf).max(axis=1)
    return [float(v) if ok else None for v, ok in zip(top.tolist(), known.any(axis=1).tolist())]


def _nanargmax_rows(values: np.ndarray) -> list[int | None]:
    """[L, W] with NaN for unknown -> per row the index of the largest known value (None where none)."""
    known = np.isfinite(values)
    at = np.where(known, values, -np.inf).argmax(axis=1)
    return [int(i) if ok else None for i, ok in zip(at.tolist(), known.any(axis=1).tolist())]


def _finite_column(values: np.ndarray | None, num_layers: int) -> list[Any]:
    """[L] values -> L JSON-safe floats (None where not finite, or all None without the values)."""
    if values is None:
        return [None] * num_layers
    return [v if math.isfinite(v) else None for v in np.asarray(values, dtype=np.float64).tolist()]


def _int_column(counts: np.ndarray | None, num_layers: int) -> list[int | None]:
    """[L, E] counts -> L per-layer sums as ints (all None without the counts)."""
    return [None] * num_layers if counts is None else counts.sum(axis=1).astype(np.int64).tolist()


def diagnose_layer(w: Window, layer: int, m: dict[str, Any], t: Thresholds,
                   missing: list[str] | None = None) -> LayerDiagnosis:
    """Apply the documented order to one layer's metrics `m` (from layer_metrics). `missing`: the
    window's missing evidence kinds (computed once per window by `diagnose`)."""
    judged, idle = _judge(w, layer, m, t, list(w.missing_evidence if missing is None else missing))
    if idle:
        return judged
    return _with_actions(w, judged, t, predict(w, {layer: m}, t, np.array([layer])) if _wants_packing(judged) else None)


def _wants_packing(d: LayerDiagnosis) -> bool:
    """Whether the layer's actions rest on the packing estimates (replicate or placement)."""
    return d.verdict == IMBALANCE_BOUND or d.cause in ("volume", "placement")


def _with_actions(w: Window, d: LayerDiagnosis, t: Thresholds, pred: Predictions | None) -> LayerDiagnosis:
    actions = _rank_actions(w, d.layer, d.metrics, t, d.verdict, d.cause, d.overflow, pred)
    best = actions[0].predicted_gain if actions else 0.0
    layer_step = d.metrics["layer_seconds_per_step"]
    if not actions and "expert_load" in d.missing and d.verdict != HEALTHY:
        stake = math.nan  # no action can be planned from per-rank totals: what is at stake is unknown
    elif best == 0.0:
        stake = 0.0
    else:
        stake = math.nan if best is None or layer_step is None else best * layer_step
    return dataclasses.replace(d, actions=actions, seconds_at_stake=stake)


def _judge(w: Window, layer: int, m: dict[str, Any], t: Thresholds, missing: list[str]
           ) -> tuple[LayerDiagnosis, bool]:
    """Verdict, cause, overflow flag and evidence in the documented order (no actions yet); True
    when the layer is idle (final as it is)."""
    evidence: list[str] = []
    overflow = m["overflow_rate"] is not None and m["overflow_rate"] > t.overflow_rate
    layer_step = m["layer_seconds_per_step"]

    # Pairs seen: routed, else (per-rank totals only) computed.
    pairs = m["routed_pairs"] if m["routed_pairs"] is not None else sum(m["rank_load"] or [])
    if pairs < t.min_routed_pairs or (layer_step is not None and layer_step <= 0):
        evidence.append("The layer routed no pairs in this window: nothing to judge.")
        return LayerDiagnosis(layer, HEALTHY, None, False, m, evidence, [], 0.0, missing), True

    # 1. Is communication dominant? Transfer only: what a rank spends in the all-to-all waiting for a
    # later one is step 2's evidence (a straggler), not communication.
    share, transfer, wait = m["a2a_share"], m["a2a_transfer_share"], m["a2a_wait_share"]
    comm: bool | None = None
    if share is None:
        evidence.append(unknown_text("All-to-all share of layer time", "a2a_time"))
        step_share = tm.a2a_step_share(w)
        if step_share is not None:
            evidence.append(f"Per step, all layers together (not this layer's share): all-to-all takes "
                            f"{step_share:.0%} of step time.")
    else:
        comm = transfer >= t.comm_share
        basis = "measured waits" if w.wait_seconds is not None else "the last rank to arrive waits for nobody"
        evidence.append(
            f"All-to-all takes {share:.0%} of layer time: {transfer:.0%} transfer, {wait:.0%} waiting for a later "
            f"rank ({basis}); transfer against the threshold {t.comm_share:.0%}: "
            + ("communication dominates." if comm else "communication does not dominate."))

    # 2. Are the ranks balanced?
    busiest, cv, max_mean = m["busiest_rank"], m["rank_load_cv"], m["rank_load_max_mean"]
    imbalanced: bool | None = None
    time_even = (m["compute_max_mean"] is not None and m["compute_max_mean"] <= t.compute_straggler_max_mean)
    if cv is None:
        evidence.append(unknown_text("Rank load", "rank_load"))
    else:
        imbalanced = cv > t.rank_load_cv or max_mean > t.rank_load_max_mean
        max_min = m["rank_load_max_min"]
        max_min_text = "inf" if max_min is None else f"{max_min:.2f}"
        if imbalanced and time_even:
            # One window cannot tell ranks of different speeds (a plan made for a slow rank gives it
            # fewer pairs on purpose) from compute time that does not follow pairs: the verdict stays
            # the documented one, with time beside it.
            evidence.append(
                f"Rank load is uneven (max/mean {max_mean:.2f}) but expert compute time is even (max/mean "
                f"{m['compute_max_mean']:.2f}, time balancedness {m['time_balancedness']:.2f}): balancing pairs "
                "would not shorten compute; a plan made for rank speeds looks like this on purpose.")
        if imbalanced:
            evidence.append(
                f"Rank {busiest} computes {max_mean:.2f}x the mean load (max/min {max_min_text}, "
                f"std/mean {cv:.2f}; threshold {t.rank_load_cv:.2f}): the other ranks wait for it"
                + (" inside the all-to-all." if comm else "."))
        else:
            evidence.append(f"Ranks are balanced: std/mean {cv:.2f}, max/mean {max_mean:.2f}.")
    hot = m["hot_experts"]
    skewed = bool(hot) and m["expert_load_cv"] > t.expert_load_cv
    if hot:
        mean_expert = m["routed_pairs"] / w.num_experts
        counts = w.expert_tokens[layer, hot[:5]].tolist()  # Python ints: no numpy scalar per expert
        shown = ", ".join(f"{e} ({count / mean_expert:.1f}x)" for e, count in zip(hot[:5], counts))
        evidence.append(f"Hot experts (over {t.hot_expert_multiple:g}x the mean load): {shown}; "
                        f"expert load std/mean {m['expert_load_cv']:.2f}.")
    if m["expert_load_cv"] is None:
        evidence.append(unknown_text("Hot experts", "expert_load"))
    if imbalanced is None and skewed:
        evidence.append("Without rank load, the expert load's own dispersion is step 2's evidence: "
                        "the layer is judged imbalanced on skewed expert load.")

    # 3. Does the mapping drive the traffic?
    cross, expected = m["cross_rank_ratio"], m["expected_cross_rank_ratio"]
    mapping_driven: bool | None = None
    if cross is None:
        predicted = "" if expected is None else f" (the placement predicts {expected:.0%})"
        evidence.append(unknown_text(f"Cross-rank ratio{predicted}", "cross_rank"))
    elif expected is None:
        evidence.append(f"{cross:.0%} of pairs cross ranks; "
                        + unknown_text("what the placement predicts", "expert_load").lower())
    else:
        mapping_driven = cross > expected + t.cross_rank_margin
        evidence.append(
            f"{cross:.0%} of pairs cross ranks; the placement predicts {expected:.0%}"
            + (": the expert-to-rank mapping drives the traffic." if mapping_driven else "."))
    node_line = topology.cross_node_evidence(m.get("cross_node_ratio"), m.get("expected_cross_node_ratio"),
                                             w.world_size, w.ranks_per_node, comm, t.cross_rank_margin)
    if node_line:
        evidence.append(node_line)
    small = None if m["mean_message_bytes"] is None else m["mean_message_bytes"] < t.small_message_bytes

    if imbalanced and m["expert_load_cv"] is None:
        # Per-rank totals show the imbalance but not whether a few experts or the packing cause it.
        verdict, cause = IMBALANCE_BOUND, None
        evidence.append("Cause unknown: without per-expert counts, hot experts and an uneven packing cannot be "
                        "told apart, and no replica or placement can be planned.")
    elif imbalanced or (imbalanced is None and skewed):
        verdict, cause = IMBALANCE_BOUND, ("hot-experts" if skewed else "straggler")
    elif comm:
        verdict = COMM_BOUND
        if small:
            cause = "small-batch"
            evidence.append(f"Messages average {m['mean_message_bytes']:.0f} B, under "
                            f"{t.small_message_bytes:.0f} B: fixed per-message cost dominates.")
        elif small is None or mapping_driven is None:
            cause = None
            evidence.append("Cause unknown: message size and cross-rank traffic were not measured.")
        else:
            cause = "placement" if mapping_driven else "volume"
        slow = _slow_rank(m, t) if imbalanced is False else None
        if slow is not None:
            verdict, cause = _comm_or_straggler(w, m, t, evidence, transfer, slow, cause)
    elif (imbalanced is False and m["compute_per_pair_max_median"] is not None
          and m["compute_per_pair_max_median"] > t.compute_straggler_per_pair):
        # Per pair, not raw time: compute grows with pairs, so a rank that is merely busier (under the
        # load bar) reads slow on raw time while its speed is typical.
        verdict, cause = IMBALANCE_BOUND, "straggler"
        slow = m["slowest_per_pair_rank"]
        waited = "" if not wait else f"; the other ranks wait for it inside the all-to-all ({wait:.0%} of layer time)"
        evidence.append(f"At even load, rank {slow}'s expert compute takes {m['compute_per_pair_max_median']:.2f}x "
                        f"the median rank's time per pair (threshold {t.compute_straggler_per_pair:.2f}): a slow "
                        f"device{waited}.")
    elif (imbalanced is False and m["slow_rank_relative_speed"] is not None
          and m["slow_rank_relative_speed"] < t.straggler_relative_speed and m["slow_rank_holds_up"]):
        verdict, cause = IMBALANCE_BOUND, "straggler"
        waited = "" if not wait else f"; the others wait {wait:.0%} of layer time for it inside the all-to-all"
        evidence.append(f"At even load, rank {m['slow_rank']} computes {m['slow_rank_relative_speed']:.2f}x the median "
                        f"rank's pairs per second over all layers (threshold {t.straggler_relative_speed:.2f}): a slow "
                        f"device{waited}.")
    elif imbalanced is False and wait is not None and wait >= t.straggler_wait_share:
        # Someone arrives late although load is even and no rank's expert compute stands out (or it
        # was not timed): the delay is before this layer's experts (attention, the host, the device).
        verdict, cause = IMBALANCE_BOUND, "straggler"
        evidence.append(f"At even load, the ranks wait {wait:.0%} of layer time inside the all-to-all for rank "
                        f"{m['last_arriving_rank']}, the last to arrive (threshold {t.straggler_wait_share:.0%}).")
    else:
        verdict, cause = HEALTHY, None
    if overflow:
        evidence.append(f"Overflow: {m['overflow_rate']:.1%} of routed pairs were dropped or rerouted "
                        f"(threshold {t.overflow_rate:.0%}).")
    elif m["overflow_rate"] is None:
        evidence.append(unknown_text("Overflow", "capacity"))
    if missing:
        evidence.append(f"Verdict from the steps with evidence; missing: {', '.join(missing)}.")

    return LayerDiagnosis(layer, verdict, cause, overflow, m, evidence, [], 0.0, missing), False


def _slow_rank(m: dict[str, Any], t: Thresholds) -> tuple[int, str] | None:
    """The rank a layer's speed evidence names slow (in this layer per pair, else over the window's
    layers), with the evidence in words; None when no rank is slow."""
    per_pair = m["compute_per_pair_max_median"]
    if per_pair is not None and per_pair > t.compute_straggler_per_pair:
        return m["slowest_per_pair_rank"], (f"its expert compute takes {per_pair:.2f}x the median rank's time per pair "
                                            "in this layer")
    speed = m["slow_rank_relative_speed"]
    if speed is not None and speed < t.straggler_relative_speed and m["slow_rank_holds_up"]:
        return m["slow_rank"], f"it computes {speed:.2f}x the median rank's pairs per second over all layers"
    return None


def _comm_or_straggler(w: Window, m: dict[str, Any], t: Thresholds, evidence: list[str], transfer: float,
                       slow: tuple[int, str], comm_cause: str | None) -> tuple[str, str | None]:
    """A transfer-dominated layer at even load in a window with a slow rank: which reading comes first.

    A slow rank is slow at everything it does, its part of the all-to-all included where that part is
    its own work (a CPU-starved host, a CPU transport) or starts late: its stalls inside the collective
    lengthen the transfer of the layers they fall in, and nothing in a layer's sums tells that from a
    slow link. A slow link or the inherent volume lengthens every layer's transfer alike. So when the
    window's median layer is not transfer-dominated, this layer's long transfer is read as the slow
    rank's (straggler first); when it is, the link or volume is read first. Either way the other
    reading goes to the evidence and to `metrics.other_reading`."""
    rank, why = slow
    typical = float(np.nanmedian(tm.a2a_transfer_share(w)))
    comm_reading = {"verdict": COMM_BOUND, "cause": comm_cause}
    if typical < t.comm_share:
        m["other_reading"] = comm_reading
        evidence.append(
            f"Rank {rank} is slow ({why}), and transfer crosses the bar in this layer ({transfer:.0%}) but not in the "
            f"window's median layer ({typical:.0%}): a slow link or the volume would lengthen every layer's transfer, "
            f"while a slow rank's stalls inside the all-to-all fall in some layers and not others. Read as a straggler "
            f"first; if the layer stays transfer-dominated once rank {rank} is fixed, it is comm-bound"
            + (f" / {comm_cause}." if comm_cause else "."))
        return IMBALANCE_BOUND, "straggler"
    m["other_reading"] = {"verdict": IMBALANCE_BOUND, "cause": "straggler"}
    evidence.append(f"Rank {rank} is also slow ({why}): a straggler too, read second, because transfer dominates the "
                    f"window's median layer as well ({typical:.0%}), as a slow link or the volume makes it.")
    return COMM_BOUND, comm_cause


def _rank_actions(w: Window, layer: int, m: dict[str, Any], t: Thresholds, verdict: str, cause: str | None,
                  overflow: bool, pred: Predictions | None) -> list[Action]:
    W = w.world_size
    if w.expert_tokens is None:
        return []  # every action names experts or re-packs their load: nothing to propose from rank totals
    # Gains are relative to the busiest rank's measured load: unknown (None) without rank load.
    now_max = None if m["rank_load"] is None else float(max(np.max(m["rank_load"]), 1))
    share = m["a2a_transfer_share"]  # what a communication action can remove: the transfer, not the waiting
    actions: list[Action] = []

    def relief(after: float) -> float | None:
        return None if now_max is None or math.isnan(after) else max(0.0, 1.0 - after / now_max)

    if verdict == IMBALANCE_BOUND or cause == "volume":
        hot, extra = pred.replicate_experts[layer], int(pred.replicate_extra[layer])
        gain = relief(float(pred.replicate_max_load[layer]))
        if cause == "volume":
            # Replicas also keep pairs local: the cross-rank share falls by the replicas' local hits.
            gain = max(gain or 0.0, share * min(1.0, extra / max(w.num_slots, 1)))
        actions.append(Action("replicate", gain,
                              f"Replicate expert{'s' if len(hot) > 1 else ''} {', '.join(map(str, hot))} "
                              f"with {extra} extra slot{'s' if extra > 1 else ''}.",
                              {"experts": hot, "extra_slots": extra}))

    over = m["a2a_over_bound"]
    if cause == "volume" and over is not None and over > t.schedule_over_bound:
        # Ordering the same rows reaches the bound at best: the share of the all-to-all above it goes.
        actions.append(Action("schedule", share * (1.0 - 1.0 / over),
                              f"Order the all-to-all by Aurora's rounds (--a2a-schedule aurora): it takes "
                              f"{over:.2f}x its bound at the links' measured rates; one sender per receiver "
                              "at a time removes what senders sharing a receiver's link cost.",
                              {"schedule": "aurora", "over_bound": round(float(over), 4)}))

    if verdict == IMBALANCE_BOUND or cause == "placement":
        gain = relief(float(pred.placement_max_load[layer]))
        compute = None if w.compute_seconds is None else w.compute_seconds[layer]
        if (cause == "straggler" and compute is not None and m["rank_load"] is not None and w.layer_seconds is not None
                and compute.max() > 0 and np.all(compute > 0)):
            # Aurora on uneven devices: load in proportion to each rank's speed, heaviest to fastest.
            speed = np.asarray(m["rank_load"], dtype=np.float64) / compute
            balanced_time = float(np.sum(m["rank_load"]) / speed.sum())
            compute_share = float(compute.max() / max(w.layer_seconds[layer].max(), 1e-12))
            speed_gain = compute_share * (1.0 - balanced_time / float(compute.max()))
            if speed_gain > (gain or 0.0):
                gain = speed_gain
                relative = speed / speed.max()
                actions.append(Action(
                    "placement", gain,
                    "Re-solve the expert placement with each rank's speed (moewatch plan --rank-speed "
                    f"{','.join(f'{v:.2f}' for v in relative)}): load in proportion to speed, heaviest to fastest.",
                    {"rank_speed": [round(float(v), 4) for v in relative]}))
        if cause == "placement":
            cross, expected = m["cross_rank_ratio"], m["expected_cross_rank_ratio"]
            gain = max(gain or 0.0, share * (cross - expected) / max(cross, 1e-9))
        if not any(a.kind == "placement" for a in actions):
            actions.append(Action("placement", gain,
                                  "Re-solve the expert placement (moewatch plan): balance rank load"
                                  + (" and co-locate experts tokens use together." if cause == "placement" else "."),
                                  {}))

    if overflow:
        routed = w.expert_tokens[layer:layer + 1]
        value = min(round_up_capacity(float(mean_load_capacities(routed, t.overflow_target)[0])),
                    t.max_capacity_factor)
        current = float(w.capacity_factor[layer])
        value = max(value, current)
        left = float(mean_load_overflow_rates(routed, np.array([value]))[0])
        actions.append(Action("capacity", 0.0,
                              f"Raise the capacity factor from {current:g} to {value:g}: predicted overflow "
                              f"{m['overflow_rate']:.1%} -> {left:.1%} (more expert memory, no latency gain).",
                              {"value": value, "predicted_overflow": round(left, 4)}))
    elif verdict == IMBALANCE_BOUND and cause == "hot-experts" and now_max is not None:
        # Capping the hot experts levels the ranks, paid for in dropped pairs (never offered on an
        # unknown gain: a lossy action has to show what it buys).
        value = float(pred.capacity[layer])
        if value > 0:
            gain = relief(float(pred.cap_max_load[layer]))
            drop = float(pred.cap_overflow[layer])
            actions.append(Action("capacity", gain,
                                  f"Cap experts at capacity factor {value:g}: levels the ranks at the cost of "
                                  f"{drop:.1%} of pairs dropped or rerouted.",
                                  {"value": value, "predicted_overflow": round(drop, 4), "lossy": True}))

    if cause == "small-batch":
        # Fixed per-collective cost is paid per step: doubling the batch halves it per token.
        actions.append(Action("batch", share * 0.5,
                              "Raise the batch (or chunked-prefill size) to amortise per-collective cost; "
                              "it adds queueing delay, so check TTFT against its SLO.", {"factor": 2}))
    # Actions that drop pairs trade model quality for speed: an operator opts into them, so they rank
    # after every lossless action whatever their gain. An unknown gain ranks after the known ones.
    # An action predicted to save under 1 % is noise, except a capacity raise: it cures drops, not time.
    actions = [a for a in actions if a.predicted_gain is None or a.predicted_gain >= 0.01
               or (a.kind == "capacity" and overflow)]
    actions.sort(key=lambda a: (bool(a.params.get("lossy")), a.predicted_gain is None, -(a.predicted_gain or 0.0)))
    return actions


def diagnose(w: Window, t: Thresholds | None = None) -> WindowDiagnosis:
    """Triage every layer of a window and summarise it."""
    t = t or Thresholds()
    metrics = layer_metrics(w, t)
    missing = w.missing_evidence
    judged = [_judge(w, i, m, t, missing) for i, m in enumerate(metrics)]
    # The packing estimates of every layer that needs them, in one batch.
    wanted = np.array([d.layer for d, idle in judged if not idle and _wants_packing(d)], dtype=np.int64)
    pred = predict(w, metrics, t, wanted)
    layers = [d if idle else _with_actions(w, d, t, pred) for d, idle in judged]
    identity = {"schema": "moewatch.diagnosis/v1", "runtime": w.runtime, "model": w.model,
                "ep_group": w.ep_group, "epoch": w.epoch, "world_size": w.world_size,
                "num_layers": w.num_layers, "num_experts": w.num_experts, "num_slots": w.num_slots,
                "steps": w.steps, "start_time": w.start_time, "end_time": w.end_time}
    return WindowDiagnosis(identity, layers, summarise(w, layers, t))


def summarise(w: Window, layers: list[LayerDiagnosis], t: Thresholds) -> dict[str, Any]:
    """Worst layers first, the slowest rank, experts hot in many layers, verdict counts, and the
    evidence the window lacked (`missing` kinds, `absent_fields`)."""
    ranked = sorted(layers, key=_severity_key)
    slowest: dict[str, Any] = {"rank": None, "compute_share": None, "compute_seconds": None}
    if w.compute_seconds is not None:
        compute_by_rank = w.compute_seconds.sum(axis=0)
        rank = int(np.argmax(compute_by_rank))
        total = float(compute_by_rank.sum())
        slowest = {"rank": rank,
                   "compute_share": _finite(float(compute_by_rank[rank]) / total) if total > 0 else None,
                   "compute_seconds": _finite(float(compute_by_rank[rank]))}
    hot_counts = Counter(e for d in layers for e in d.metrics["hot_experts"] or [])
    balanced = tm.balancedness(w)
    steps = w.step_seconds
    timed = steps is not None and len(steps) > 0
    return {
        "verdicts": {v: sum(d.verdict == v for d in layers) for v in VERDICTS},
        "overflow_layers": [d.layer for d in layers if d.overflow],
        "worst_layers": [d.layer for d in ranked if d.verdict != HEALTHY or d.overflow][:10],
        "slowest_rank": slowest,
        # Each rank's pairs per second of expert compute, and over the median rank's (None: not timed).
        "rank_speed": None if tm.relative_rank_speed(w) is None else _rank_speed_section(w),
        "hot_experts_across_layers": [{"expert": int(e), "layers": n} for e, n in hot_counts.most_common(10)],
        "balancedness_mean": None if balanced is None else _finite(float(np.mean(balanced))),
        "step_p50_seconds": _finite(float(np.percentile(steps, 50))) if timed else None,
        "step_p99_seconds": _finite(float(np.percentile(steps, 99))) if timed else None,
        "tokens_per_second": (_finite(float(w.step_tokens.sum() / steps.sum()))
                              if timed and w.step_tokens is not None and steps.sum() > 0 else None),
        # Step 1 per step (all layers together), where the all-to-all time is known only per step.
        "a2a_step_share": _finite(tm.a2a_step_share(w)),
        "a2a_step_seconds": _finite(tm.step_a2a_seconds(w)),
        # The engine's own SLOs over the window, where a source stamped them (moewatch/slo.py).
        "slo": slo_signals.section(w.extra.get(slo_signals.SLO_KEY), layers),
        "missing": w.missing_evidence,
        "absent_fields": w.absent_fields,
    }


def _rank_speed_section(w: Window) -> dict[str, list[float | None]]:
    """Each rank's pairs per compute second and its ratio to the median rank's (telemetry)."""
    return {"pairs_per_second": [_finite(float(x)) for x in tm.rank_speed(w)],
            "relative": [_finite(float(x)) for x in tm.relative_rank_speed(w)]}