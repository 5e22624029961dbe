"""One EP group's window from its shards (docs/telemetry.md, "Shards").

A process that routes only a share of its group's tokens (every DP rank under data-parallel
attention; every TP rank where the engine chunks tokens across TP before the MoE layer) sends a
shard: an ordinary Window whose counts are its own tokens' pairs, whose [L][W] timings are its own
rank's column, and whose `extra.shard` says which shard of how many it is, the EP rank whose tokens
it routed, and the window sequence every shard of one window shares. The functions here are pure:
which shards of a sequence agree (`agreement`), and the whole window they make (`merge_shards`).
The agent's stateful part (holding sequences, the deadline, counting) is agent/shards.py.

Sizes: L layers, E logical experts, P slots, W ranks, S steps, n shards.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable, Sequence

import numpy as np

from .numpy_json import numpy_default
from .telemetry import SHARD_KEY, SHARDS_KEY, STEP_A2A_KEY, Shard, ShardsReport, Window, parse_shard

# Why a shard of a sequence is left out of its merged window (the reason label of the agent's counter).
SIZES_MISMATCH = "sizes_mismatch"  # world_size, ranks_per_node, L, E, P, top_k, hidden_bytes or capacity factor
MAP_MISMATCH = "map_mismatch"
EPOCH_MISMATCH = "epoch_mismatch"
COUNT_MISMATCH = "count_mismatch"
DISAGREEMENTS = (COUNT_MISMATCH, SIZES_MISMATCH, MAP_MISMATCH, EPOCH_MISMATCH)  # in the order they are told apart

# Extra keys of a merged window: each rank's own step seconds ([W] lists, null for a rank no shard
# covered), and the engine's rebalance records (one per call).
RANK_STEP_SECONDS_KEY = "rank_step_seconds"
REBALANCE_KEY = "engine_rebalance"
TIMING_FIELDS = ("dispatch_seconds", "combine_seconds", "compute_seconds", "layer_seconds", "wait_seconds")


def shard_extra(index: int, count: int, rank: int, sequence: int, world_size: int) -> dict[str, dict[str, int]]:
    """{"shard": {...}} for an engine adapter's window extra: shard `index` of `count`, routing EP rank
    `rank`'s tokens, of window `sequence`. Checked as a reader checks it (WindowError naming
    `shard.<key>`), so an adapter never sends a shard the agent refuses."""
    shard = {"index": index, "count": count, "rank": rank, "sequence": sequence}
    parse_shard(shard, world_size)
    return {SHARD_KEY: shard}


def policy_digest(*parts: Any) -> str:
    """Hex SHA-256 over a rebalance's inputs, settings and result, the same on every rank that computed
    the same thing: arrays by value (integers as int64, floats as float64, little-endian, with their
    shape), anything else as sorted-key JSON. An engine adapter puts it in its rebalance record
    (`digest`, with the call's ordinal `call`), and the agent compares it across shards."""
    h = hashlib.sha256()
    for part in parts:
        if hasattr(part, "__array__") and not isinstance(part, (list, tuple, dict)):
            arr = np.asarray(part)
            kind = arr.dtype.kind
            canonical = arr.astype("<i8" if kind in "iub" else "<f8")
            h.update(f"array{list(arr.shape)}{canonical.dtype.str}".encode())
            h.update(np.ascontiguousarray(canonical).tobytes())
        else:
            h.update(b"json")
            h.update(json.dumps(part, sort_keys=True, separators=(",", ":"), allow_nan=False,
                                default=numpy_default).encode())
        h.update(b"\0")
    return h.hexdigest()


def rebalance_digests(w: Window) -> dict[int, str]:
    """{call: digest} of the rebalance records a window carries with both (extra.engine_rebalance)."""
    records = w.extra.get(REBALANCE_KEY)
    out: dict[int, str] = {}
    if not isinstance(records, list):
        return out
    for record in records:
        if not isinstance(record, dict):
            continue
        call, digest = record.get("call"), record.get("digest")
        if isinstance(call, int) and not isinstance(call, bool) and isinstance(digest, str):
            out.setdefault(call, digest)
    return out


def _signature(w: Window) -> tuple:
    """What every shard of one window must share, in DISAGREEMENTS order."""
    shard = w.shard
    sizes = (w.world_size, w.ranks_per_node, w.num_layers, w.num_experts, w.num_slots, w.top_k, w.hidden_bytes,
             w.capacity_factor.tobytes())
    return (shard.count, sizes, w.physical_to_logical_map.tobytes(), w.epoch)


def agreement(shards: Sequence[Window]) -> tuple[list[Window], list[tuple[Window, str]]]:
    """Split one sequence's shards into those that agree (the most shards that share count, sizes,
    map and epoch; on a tie, the side holding the lowest shard index) and the refused ones, each with
    the first thing it disagrees on (DISAGREEMENTS). Never half-merges: a refused shard adds nothing.

    shards: windows that each carry `extra.shard`, distinct shard indices."""
    if not shards:
        return [], []
    groups: dict[tuple, list[Window]] = {}
    for w in sorted(shards, key=lambda w: w.shard.index):
        groups.setdefault(_signature(w), []).append(w)
    chosen = max(groups, key=lambda sig: (len(groups[sig]), -groups[sig][0].shard.index))
    refused = []
    for sig, members in groups.items():
        if sig == chosen:
            continue
        reason = next(r for r, mine, theirs in zip(DISAGREEMENTS, sig, chosen) if mine != theirs)
        refused += [(w, reason) for w in members]
    return groups[chosen], sorted(refused, key=lambda item: item[0].shard.index)


def counts_received(w: Window) -> bool:
    """Whether the shard's slot counts are what its rank's slots received from every rank (a source
    that sees only its own slots' receptions says `extra.source.counts = "received"`), not what its
    own tokens routed: summed over shards they are still each slot's load, but they form no row of
    the rank-to-rank traffic."""
    source = w.extra.get("source")
    return isinstance(source, dict) and source.get("counts") == "received"


def source_slot_tokens(w: Window) -> np.ndarray | None:
    """[L, P] pairs per slot that the shard's tokens made: its slot_tokens, or, where every logical
    expert has exactly one slot (P = E), its kept pairs per expert through the map, when capacity
    is known to move none (dropless, or no rerouted pairs). None when neither can be said, or when
    the counts are receptions (`counts_received`)."""
    if counts_received(w):
        return None
    if w.slot_tokens is not None:
        return w.slot_tokens
    if w.expert_tokens is None or w.num_slots != w.num_experts:
        return None
    dropless = not np.any(w.capacity_factor)
    rerouted_none = w.rerouted_tokens is not None and not w.rerouted_tokens.any()
    if not dropless and not (rerouted_none and w.dropped_tokens is not None):
        return None  # dropped or rerouted pairs unknown: which slot computed what is not known
    kept = w.expert_tokens if w.dropped_tokens is None else w.expert_tokens - w.dropped_tokens
    return np.take_along_axis(kept, w.physical_to_logical_map, axis=1)


def traffic_from_sources(source_ranks: Sequence[int], slot_counts: Sequence[np.ndarray], world_size: int) -> np.ndarray:
    """[L, W, W] pairs from rank i to rank j: each shard's slot counts [L, P] form the row of its
    source rank, slot s counting on rank s // (P // W); shards of one rank add up."""
    first = slot_counts[0]
    L, P = first.shape
    W = world_size
    traffic = np.zeros((L, W, W), dtype=np.int64)
    for rank, slots in zip(source_ranks, slot_counts):
        traffic[:, rank, :] += slots.reshape(L, W, P // W).sum(axis=2)
    return traffic


def _summed(shards: Sequence[Window], name: str) -> np.ndarray | None:
    arrays = [getattr(w, name) for w in shards]
    return None if any(a is None for a in arrays) else np.sum(arrays, axis=0)


def _step_data(shards: Sequence[Window]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """([S] step seconds: each step's slowest shard, [S] tokens summed per step) when every shard that
    ran steps has the same steps and carries them (a shard of no steps, an idle rank's, adds none);
    None for either otherwise."""
    shards = [w for w in shards if w.steps > 0] or list(shards)
    if len({w.steps for w in shards}) != 1:
        return None, None
    seconds = [w.step_seconds for w in shards]
    tokens = _summed(shards, "step_tokens")
    return (None if any(s is None for s in seconds) else np.max(seconds, axis=0)), tokens


def _rank_step_seconds(shards: Sequence[Window], world_size: int) -> list[list[float] | None] | None:
    """[W] each rank's own step seconds (a rank with several shards: per step the slowest when they
    have the same steps, else the first's), None for a rank no shard with step seconds covered."""
    out: list[list[float] | None] = [None] * world_size
    timed = False
    for w in shards:
        if w.step_seconds is None:
            continue
        timed = True
        rank = w.shard.rank
        mine = w.step_seconds.tolist()
        theirs = out[rank]
        out[rank] = mine if theirs is None else (np.maximum(theirs, mine).tolist() if len(theirs) == len(mine)
                                                 else theirs)
    return out if timed else None


def _rebalance_records(shards: Sequence[Window]) -> list[dict[str, Any]] | None:
    """The engine's rebalance records, each once: a record with a `call` once per call (the lowest
    shard's), records without one from the lowest shard only (every rank records the same rebalance)."""
    records: list[dict[str, Any]] = []
    calls: set[int] = set()
    any_list = False
    for position, w in enumerate(shards):
        items = w.extra.get(REBALANCE_KEY)
        if not isinstance(items, list):
            continue
        any_list = True
        for record in items:
            call = record.get("call") if isinstance(record, dict) else None
            if isinstance(call, int) and not isinstance(call, bool):
                if call not in calls:
                    calls.add(call)
                    records.append(record)
            elif position == 0:
                records.append(record)
    return records if any_list else None


def merge_shards(shards: Sequence[Window], missing: Iterable[int] = (), refused: Iterable[int] = ()) -> Window:
    """One whole window of the group from agreeing shards of one sequence (as `agreement` keeps them).

    Counts (expert, slot, dropped, rerouted, rank totals) are summed; a field some shard lacks is
    absent. The rank-to-rank `traffic` [L, W, W] and local / sent / received [L, W] are built from each
    shard's source rank and its slot counts (`source_slot_tokens`); absent when a shard has neither
    or counts receptions (then the slot counts are still summed, when every shard has them).
    Timings [L, W] are taken per column from the shard that routed that rank, and are absent unless
    the shards cover every rank (a rank nobody measured is unknown, not idle). start = min, end =
    max, steps = max; step seconds per step the slowest shard and step tokens summed, when all that
    ran steps have the same steps; each rank's own step seconds under extra.rank_step_seconds. The window names its
    shards under extra.shards (count, received, missing, refused); other extra keys come from the
    lowest shard, the all-to-all step total (extra.a2a_step_seconds) is the mean of the shards'.
    Raises ValueError for shards that are not one agreeing set, WindowError if the result breaks an
    invariant (a shard that lied about its counts)."""
    if not shards:
        raise ValueError("no shards to merge")
    shards = sorted(shards, key=lambda w: w.shard.index)
    infos: list[Shard] = [w.shard for w in shards]
    if any(info is None for info in infos):
        raise ValueError("a window without extra.shard is not a shard")
    if len({info.index for info in infos}) != len(infos):
        raise ValueError("two shards with the same index")
    if len({info.sequence for info in infos}) != 1 or len({_signature(w) for w in shards}) != 1:
        raise ValueError("shards of different sequences, or that disagree (see agreement)")
    first = shards[0]
    L, P, W = first.num_layers, first.num_slots, first.world_size
    count = infos[0].count

    fields: dict[str, Any] = {name: getattr(first, name) for name in (
        "runtime", "model", "ep_group", "world_size", "ranks_per_node", "num_layers", "num_experts", "num_slots",
        "top_k", "epoch", "hidden_bytes", "physical_to_logical_map", "capacity_factor")}
    fields.update(steps=max(w.steps for w in shards), start_time=min(w.start_time for w in shards),
                  end_time=max(w.end_time for w in shards))
    for name in ("expert_tokens", "dropped_tokens", "rerouted_tokens", "rank_tokens"):
        fields[name] = _summed(shards, name)

    sources = [source_slot_tokens(w) for w in shards]
    if all(s is not None for s in sources):
        traffic = traffic_from_sources([i.rank for i in infos], sources, W)
        local = np.diagonal(traffic, axis1=1, axis2=2).copy()
        fields.update(slot_tokens=np.sum(sources, axis=0), traffic=traffic, local_tokens=local,
                      sent_tokens=traffic.sum(axis=2) - local, received_tokens=traffic.sum(axis=1) - local)
    else:
        fields.update(slot_tokens=_summed(shards, "slot_tokens"), traffic=None, local_tokens=None,
                      sent_tokens=None, received_tokens=None)

    covered = {i.rank for i in infos} == set(range(W))
    for name in TIMING_FIELDS:
        if not covered or any(getattr(w, name) is None for w in shards):
            fields[name] = None
            continue
        merged = np.zeros((L, W), dtype=np.float64)
        for w, info in zip(shards, infos):
            merged[:, info.rank] += getattr(w, name)[:, info.rank]
        fields[name] = merged

    fields["step_seconds"], fields["step_tokens"] = _step_data(shards)

    extra = {k: v for k, v in first.extra.items() if k not in (SHARD_KEY, REBALANCE_KEY, STEP_A2A_KEY)}
    step_a2a = [float(w.extra[STEP_A2A_KEY]) for w in shards if STEP_A2A_KEY in w.extra]
    if step_a2a:
        extra[STEP_A2A_KEY] = float(np.mean(step_a2a))
    records = _rebalance_records(shards)
    if records is not None:
        extra[REBALANCE_KEY] = records
    rank_steps = _rank_step_seconds(shards, W)
    if rank_steps is not None:
        extra[RANK_STEP_SECONDS_KEY] = rank_steps
    report = ShardsReport(count, tuple(i.index for i in infos), tuple(sorted(set(missing))),
                          tuple(sorted(set(refused))))
    extra[SHARDS_KEY] = report.to_dict()
    fields["extra"] = extra
    return Window(**fields)


def merge_sequence(shards: Sequence[Window]) -> tuple[Window, list[tuple[Window, str]]]:
    """One sequence's shards, as they came, to (its whole window, the refused shards with their
    reasons): the agreeing ones (`agreement`) merged, the window naming as missing every index of the
    count that neither came nor was refused. Raises WindowError or ValueError as merge_shards does.

    shards: windows that each carry `extra.shard`, distinct shard indices, one sequence."""
    kept, refused = agreement(shards)
    if not kept:
        raise ValueError("no shards to merge")
    count = kept[0].shard.count
    refused_indices = sorted({w.shard.index for w, _ in refused if w.shard.index < count})
    missing = sorted(set(range(count)) - {w.shard.index for w in kept} - set(refused_indices))
    return merge_shards(kept, missing=missing, refused=refused_indices), refused


def merge_recorded(windows: Sequence[Window]) -> tuple[list[Window], list[tuple[Window, str]]]:
    """Recorded windows (a folder's, files given) -> (whole windows: each unsharded one as it is and each
    shard sequence merged as the agent merges it, in the order the sequences first appear; the shards
    refused, with why). A shard read twice counts once. ValueError naming the group and sequence when a
    sequence's shards do not merge."""
    whole: list[Window] = []
    sequences: dict[tuple[str, str, int], dict[int, Window]] = {}
    for w in windows:
        if w.shard is None:
            whole.append(w)
        else:
            sequences.setdefault((w.model, w.ep_group, w.shard.sequence), {})[w.shard.index] = w
    refused: list[tuple[Window, str]] = []
    for (model, group, sequence), by_index in sequences.items():
        try:
            merged, left_out = merge_sequence(list(by_index.values()))
        except ValueError as exc:  # WindowError included
            raise ValueError(f"{model}/{group} window sequence {sequence}: its shards do not merge: {exc}") from None
        whole.append(merged)
        refused += left_out
    return whole, refused
