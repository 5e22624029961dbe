"""The Window: one sampling window of one EP group, aggregated over its ranks.

The contract is docs/telemetry.md. A Window is immutable once built
and always valid: every constructor path runs `validate`, which rejects the whole window with a
`WindowError` naming the first field that breaks an invariant. Nothing downstream re-checks shapes.

Sizes used in docstrings: L layers, E logical experts, P physical slots, W ranks, S steps.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .checks import (check_at_least_one, check_placement, check_ranks_per_node, check_slots_divide,
                     check_slots_hold_experts)
from .errors import InputError
from .planner.placement_math import holder_counts

SCHEMA = "moewatch.window/v1"

# name -> (dtype kind, shape as a tuple of size names). "i" arrays hold non-negative integer counts,
# "f" arrays finite non-negative seconds or factors. Order is the JSON and binary order.
ARRAY_FIELDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "physical_to_logical_map": ("i", ("L", "P")),
    "expert_tokens": ("i", ("L", "E")),
    "slot_tokens": ("i", ("L", "P")),
    "dropped_tokens": ("i", ("L", "E")),
    "rerouted_tokens": ("i", ("L", "E")),
    "capacity_factor": ("f", ("L",)),
    "local_tokens": ("i", ("L", "W")),
    "sent_tokens": ("i", ("L", "W")),
    "received_tokens": ("i", ("L", "W")),
    "traffic": ("i", ("L", "W", "W")),
    "dispatch_seconds": ("f", ("L", "W")),
    "combine_seconds": ("f", ("L", "W")),
    "compute_seconds": ("f", ("L", "W")),
    "layer_seconds": ("f", ("L", "W")),
    "step_seconds": ("f", ("S",)),
    "step_tokens": ("i", ("S",)),
    # Additive v1 extension: per-rank totals, for a source that sees no per-expert counts.
    "rank_tokens": ("i", ("L", "W")),
    # Additive v1 extension: all-to-all seconds each rank spent waiting for later ranks, from a
    # source that measures it (DeepEP's per-source wait counters); part of dispatch + combine.
    "wait_seconds": ("f", ("L", "W")),
    # Additive v1 extension: Aurora's all-to-all bound per layer (dispatch + combine, summed over the
    # window's steps, at the links' known rates) and the measured all-to-all time over it, from a
    # source that knows its link rates (the reference runtime on emulated or declared links).
    "a2a_bound_seconds": ("f", ("L",)),
    "a2a_over_bound": ("f", ("L",)),
}
# Absent evidence (docs/telemetry.md): a source that cannot measure a field leaves it out (None here, null in
# JSON, no entry in the binary form) rather than guessing it. Only the placement, the routed counts
# and the capacity factor in force are always present; the routed counts (expert_tokens) may be left
# out only when rank_tokens stands in for them (a source that sees only per-rank totals, such as
# SGLang's /metrics heatmap): REQUIRED_UNLESS.
REQUIRED_ARRAYS = frozenset({"physical_to_logical_map", "expert_tokens", "capacity_factor"})
OPTIONAL_ARRAYS = frozenset(ARRAY_FIELDS) - REQUIRED_ARRAYS
REQUIRED_UNLESS = {"expert_tokens": "rank_tokens"}
# Window.extra key: the window's all-to-all seconds (all layers, summed over its steps, the mean over
# the ranks measured) from a source that cannot match its records to layers (docs/telemetry.md).
STEP_A2A_KEY = "a2a_step_seconds"

# What each triage step needs, by evidence kind: any one alternative fully present is enough.
# The kinds are the label values of moewatch_layer_evidence_missing and the `missing` lists of a
# diagnosis (docs/telemetry.md, "Absent evidence").
EVIDENCE: dict[str, tuple[tuple[str, ...], ...]] = {
    "a2a_time": (("dispatch_seconds", "combine_seconds", "layer_seconds"),),  # triage step 1
    "rank_load": (("slot_tokens",), ("local_tokens", "received_tokens"), ("rank_tokens",)),  # triage step 2
    "cross_rank": (("local_tokens", "sent_tokens"),),  # triage step 3
    "capacity": (("dropped_tokens", "rerouted_tokens"),),  # the overflow flag
    "compute_time": (("compute_seconds",),),  # a slow device at even load
    "layer_time": (("layer_seconds",),),  # seconds at stake
    "steps": (("step_seconds", "step_tokens"),),  # step time, tokens per second
    "expert_load": (("expert_tokens",),),  # hot experts, expected traffic, routed pairs, any plan
}

# A shard of its group's window (docs/telemetry.md, "Shards"): the extra key a process that routes only a
# share of the group's tokens writes, {"index", "count", "rank", "sequence"}; and the key a merged
# window names its shards under, {"count", "received", "missing", "refused"} (missing or refused ones
# make the missing-evidence kind SHARDS_EVIDENCE).
SHARD_KEY = "shard"
SHARDS_KEY = "shards"
SHARDS_EVIDENCE = "shards"
# Every missing-evidence kind: the field kinds, then the window-level one.
EVIDENCE_KINDS: tuple[str, ...] = (*EVIDENCE, SHARDS_EVIDENCE)

SCALAR_FIELDS: dict[str, type] = {
    "runtime": str,
    "model": str,
    "ep_group": str,
    "world_size": int,
    "ranks_per_node": int,
    "num_layers": int,
    "num_experts": int,
    "num_slots": int,
    "top_k": int,
    "epoch": int,
    "steps": int,
    "start_time": float,
    "end_time": float,
    "hidden_bytes": int,
}


class WindowError(InputError):
    """A window broke the contract; `field` names the first offending field."""


@dataclass(frozen=True)
class Shard:
    """Which share of its EP group's window a window is (`extra.shard`): shard `index` of `count`, the
    tokens EP rank `rank` routed, in the window `sequence` every shard of one window shares."""

    index: int
    count: int
    rank: int
    sequence: int

    def to_dict(self) -> dict[str, int]:
        return {"index": self.index, "count": self.count, "rank": self.rank, "sequence": self.sequence}


def parse_shard(value: Any, world_size: int) -> Shard:
    """The `shard` object of a window of `world_size` ranks as a Shard; WindowError naming
    `shard.<key>` when it is malformed or out of range (unknown keys are left alone)."""
    if not isinstance(value, Mapping):
        raise WindowError(SHARD_KEY, f"expected an object {{index, count, rank, sequence}}, got {type(value).__name__}")
    parsed = {}
    for key in ("index", "count", "rank", "sequence"):
        if key not in value:
            raise WindowError(f"{SHARD_KEY}.{key}", "missing")
        item = value[key]
        if isinstance(item, bool) or not isinstance(item, (int, np.integer)) or item < 0:
            raise WindowError(f"{SHARD_KEY}.{key}", f"expected a non-negative integer, got {item!r}")
        parsed[key] = int(item)
    if parsed["count"] < 1:
        raise WindowError(f"{SHARD_KEY}.count", "must be at least 1")
    if parsed["index"] >= parsed["count"]:
        raise WindowError(f"{SHARD_KEY}.index", f"{parsed['index']} is outside [0, count {parsed['count']})")
    if parsed["rank"] >= world_size:
        raise WindowError(f"{SHARD_KEY}.rank", f"{parsed['rank']} is outside [0, world_size {world_size})")
    return Shard(**parsed)


@dataclass(frozen=True)
class ShardsReport:
    """A merged window's account of its shards (`extra.shards`): shard indices in [0, count) that
    were merged (`received`), never arrived by the deadline (`missing`), or were refused (`refused`:
    they disagreed with the others on sizes, map or epoch)."""

    count: int
    received: tuple[int, ...]
    missing: tuple[int, ...] = ()
    refused: tuple[int, ...] = ()

    @property
    def absent(self) -> tuple[int, ...]:
        """Shards the window lacks: missing or refused."""
        return tuple(sorted({*self.missing, *self.refused}))

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "received": list(self.received), "missing": list(self.missing),
                "refused": list(self.refused)}


def parse_shards_report(value: Any) -> ShardsReport:
    """The `shards` object of a merged window; WindowError naming `shards.<key>` when malformed."""
    if not isinstance(value, Mapping):
        raise WindowError(SHARDS_KEY, f"expected an object {{count, received, missing, refused}}, "
                                      f"got {type(value).__name__}")
    count = value.get("count")
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise WindowError(f"{SHARDS_KEY}.count", f"expected an integer >= 1, got {count!r}")
    lists = {}
    for key in ("received", "missing", "refused"):
        items = value.get(key, [])
        if not isinstance(items, list) or any(isinstance(i, bool) or not isinstance(i, (int, np.integer))
                                              or not 0 <= i < count for i in items):
            raise WindowError(f"{SHARDS_KEY}.{key}", f"expected a list of shard indices in [0, {count})")
        lists[key] = tuple(int(i) for i in items)
    return ShardsReport(int(count), **lists)


@dataclass(frozen=True, eq=False, kw_only=True)
class Window:
    runtime: str
    model: str
    ep_group: str
    world_size: int
    ranks_per_node: int
    num_layers: int
    num_experts: int
    num_slots: int
    top_k: int
    epoch: int
    steps: int
    start_time: float
    end_time: float
    hidden_bytes: int
    physical_to_logical_map: np.ndarray
    expert_tokens: np.ndarray | None = None
    slot_tokens: np.ndarray | None = None
    dropped_tokens: np.ndarray | None = None
    rerouted_tokens: np.ndarray | None = None
    capacity_factor: np.ndarray
    local_tokens: np.ndarray | None = None
    sent_tokens: np.ndarray | None = None
    received_tokens: np.ndarray | None = None
    traffic: np.ndarray | None = None
    dispatch_seconds: np.ndarray | None = None
    combine_seconds: np.ndarray | None = None
    compute_seconds: np.ndarray | None = None
    layer_seconds: np.ndarray | None = None
    step_seconds: np.ndarray | None = None
    step_tokens: np.ndarray | None = None
    rank_tokens: np.ndarray | None = None
    wait_seconds: np.ndarray | None = None
    a2a_bound_seconds: np.ndarray | None = None
    a2a_over_bound: np.ndarray | None = None
    # Fields this reader does not know, kept so a round trip is lossless.
    extra: Mapping[str, Any] = field(default_factory=dict)
    schema: str = SCHEMA

    def __post_init__(self) -> None:
        for name, (kind, _) in ARRAY_FIELDS.items():
            value = getattr(self, name)
            if value is None and (name in OPTIONAL_ARRAYS or name in REQUIRED_UNLESS):
                continue  # a required one that is absent is refused by validate, naming it
            object.__setattr__(self, name, _as_array(name, kind, value))
        for name, typ in SCALAR_FIELDS.items():
            object.__setattr__(self, name, _as_scalar(name, typ, getattr(self, name)))
        object.__setattr__(self, "extra", dict(self.extra))
        validate(self)
        for name in ARRAY_FIELDS:
            value = getattr(self, name)
            if value is not None:
                value.setflags(write=False)

    # --- evidence --------------------------------------------------------------------------------
    def has(self, *names: str) -> bool:
        """Whether every named array field is present (not absent evidence)."""
        return all(getattr(self, name) is not None for name in names)

    @property
    def absent_fields(self) -> list[str]:
        """Array fields this window leaves out, in field order."""
        return [name for name in ARRAY_FIELDS if getattr(self, name) is None]

    @property
    def missing_evidence(self) -> list[str]:
        """Evidence kinds (EVIDENCE_KINDS) this window cannot support, in that order: the field kinds
        (EVIDENCE), then `shards` when a merged window lacks some of its group's shards."""
        kinds = [kind for kind, options in EVIDENCE.items() if not any(self.has(*opt) for opt in options)]
        report = self.shards_report
        if report is not None and report.absent:
            kinds.append(SHARDS_EVIDENCE)
        return kinds

    @property
    def shard(self) -> Shard | None:
        """Which shard of its group's window this is (extra.shard), or None for a whole window."""
        value = self.extra.get(SHARD_KEY)
        return None if value is None else parse_shard(value, self.world_size)

    @property
    def shards_report(self) -> ShardsReport | None:
        """A merged window's account of its shards (extra.shards), or None."""
        value = self.extra.get(SHARDS_KEY)
        return None if value is None else parse_shards_report(value)

    @property
    def nbytes(self) -> int:
        """Bytes the window's arrays hold (what a history of windows costs in memory)."""
        return sum(getattr(self, name).nbytes for name in ARRAY_FIELDS if getattr(self, name) is not None)

    # --- sizes -----------------------------------------------------------------------------------
    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.world_size

    @property
    def slot_rank(self) -> np.ndarray:
        """[P] rank that holds each slot."""
        return np.arange(self.num_slots) // self.slots_per_rank

    # --- forms -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": self.schema}
        for name in SCALAR_FIELDS:
            out[name] = getattr(self, name)
        for name in ARRAY_FIELDS:
            value = getattr(self, name)
            out[name] = None if value is None else value.tolist()
        for key, value in self.extra.items():
            out.setdefault(key, value)
        return out

    def to_json(self, indent: int | None = None) -> str:
        # repr-exact floats: json writes the shortest string that reads back to the same double.
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, data: Any) -> "Window":
        if not isinstance(data, dict):
            raise WindowError("<root>", f"expected a JSON object, got {type(data).__name__}")
        schema = data.get("schema")
        if schema != SCHEMA:
            raise WindowError("schema", f"unknown schema {schema!r}; this reader understands {SCHEMA!r}")
        kwargs: dict[str, Any] = {}
        for name in (*SCALAR_FIELDS, *ARRAY_FIELDS):
            if name not in data:
                if name in OPTIONAL_ARRAYS or name in REQUIRED_UNLESS:
                    kwargs[name] = None
                    continue
                raise WindowError(name, "missing")
            kwargs[name] = data[name]
        known = {"schema", *SCALAR_FIELDS, *ARRAY_FIELDS}
        kwargs["extra"] = {k: v for k, v in data.items() if k not in known}
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Window":
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise WindowError("<json>", f"not valid JSON ({exc})") from None
        except ValueError as exc:  # NaN / Infinity literals
            raise WindowError("<json>", str(exc)) from None
        return cls.from_dict(data)

    def to_bytes(self) -> bytes:
        return encode_binary(self)

    @classmethod
    def from_bytes(cls, blob: bytes) -> "Window":
        return decode_binary(blob)

    def replace(self, **changes: Any) -> "Window":
        """A copy with some fields changed (validated like any other window)."""
        return dataclasses.replace(self, **changes)


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name} is not allowed")


def _as_scalar(name: str, typ: type, value: Any) -> Any:
    if typ is str:
        if not isinstance(value, str):
            raise WindowError(name, f"expected a string, got {type(value).__name__}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise WindowError(name, f"expected an integer, got {value!r}")
        return int(value)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise WindowError(name, f"expected a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise WindowError(name, "must be finite")
    return value


def _as_array(name: str, kind: str, value: Any) -> np.ndarray:
    if value is None:
        raise WindowError(name, "missing")
    try:
        arr = np.asarray(value)
    except ValueError:
        raise WindowError(name, "ragged nested list (rows of different lengths)") from None
    if arr.dtype == object:
        raise WindowError(name, "ragged or non-numeric array")
    if arr.size == 0 and arr.dtype.kind not in "iuf":
        arr = arr.astype(np.int64 if kind == "i" else np.float64)
    if arr.dtype.kind == "b" or arr.dtype.kind not in "iuf":
        raise WindowError(name, f"expected numbers, got {arr.dtype}")
    if kind == "i":
        if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise WindowError(name, "count too large for a 64-bit integer")
        if arr.dtype.kind == "f":
            if not np.all(np.isfinite(arr)):
                raise WindowError(name, "counts must be finite integers")
            if not np.all(arr == np.round(arr)):
                raise WindowError(name, "counts must be integers")
        return arr.astype(np.int64)
    arr = arr.astype(np.float64)
    return arr


def validate(w: Window) -> None:
    """Check every invariant of docs/telemetry.md; raise WindowError naming the first broken field."""
    if w.schema != SCHEMA:
        raise WindowError("schema", f"unknown schema {w.schema!r}")
    sizes_at_least_one = ("world_size", "num_layers", "num_experts", "num_slots", "top_k", "ranks_per_node")
    check_at_least_one(((name, getattr(w, name)) for name in sizes_at_least_one), WindowError)
    for name in ("epoch", "steps", "hidden_bytes"):
        if getattr(w, name) < 0:
            raise WindowError(name, "must be non-negative")
    if w.start_time < 0 or w.end_time < w.start_time:
        raise WindowError("end_time", "must not be before start_time (and both non-negative)")
    L, E, P, W = w.num_layers, w.num_experts, w.num_slots, w.world_size
    check_slots_hold_experts(P, E, WindowError)
    check_slots_divide(P, W, WindowError)
    check_ranks_per_node(W, w.ranks_per_node, WindowError)
    if w.top_k > E:
        raise WindowError("top_k", f"top_k {w.top_k} exceeds {E} experts")
    sizes = {"L": L, "E": E, "P": P, "W": W, "S": w.steps}

    for name, (kind, dims) in ARRAY_FIELDS.items():
        arr = getattr(w, name)
        if arr is None:
            continue
        expected = tuple(sizes[d] for d in dims)
        if arr.shape != expected:
            pretty = "x".join(f"{d}={sizes[d]}" for d in dims)
            raise WindowError(name, f"shape {list(arr.shape)} does not match [{pretty}]")
        if kind == "f" and not np.all(np.isfinite(arr)):
            raise WindowError(name, "contains NaN or infinity")
        if np.any(arr < 0):
            raise WindowError(name, "contains negative values")

    _check_phase_times(w)
    _check_wait_times(w)
    _check_a2a_bound(w)

    check_placement(w.physical_to_logical_map, E, WindowError)

    # Invariants apply to what is present: each check runs when the fields it relates are there.
    if w.expert_tokens is None:
        # Per-rank totals stand in for the routed counts, and nothing per expert can be checked.
        if w.rank_tokens is None:
            raise WindowError("expert_tokens", "missing (required unless rank_tokens carries per-rank totals)")
        for name in ("dropped_tokens", "rerouted_tokens"):
            if getattr(w, name) is not None:
                raise WindowError(name, "present while expert_tokens is absent (capacity counts are per expert)")
    if w.rank_tokens is not None:
        # Per layer and rank, the same pairs however they were counted.
        if w.slot_tokens is not None:
            _check_layers("rank_tokens", np.any(w.slot_tokens.reshape(L, W, P // W).sum(axis=2) != w.rank_tokens,
                                                axis=1), "a rank's slot_tokens do not add up to its rank_tokens")
        if w.has("local_tokens", "received_tokens"):
            _check_layers("rank_tokens", np.any(w.local_tokens + w.received_tokens != w.rank_tokens, axis=1),
                          "a rank's local + received pairs differ from its rank_tokens")
    routed = None if w.expert_tokens is None else w.expert_tokens.sum(axis=1)
    kept = routed
    if w.dropped_tokens is not None:
        _check_layers("dropped_tokens", w.dropped_tokens > w.expert_tokens,
                      "an expert dropped more pairs than were routed to it", per_element=True)
        kept = routed - w.dropped_tokens.sum(axis=1)
    local = None if w.local_tokens is None else w.local_tokens.sum(axis=1)
    # Computed pairs: from the slots, else from local + received, else the per-rank totals (all
    # equal when present together, checked above and below).
    computed = None
    if w.slot_tokens is not None:
        computed = w.slot_tokens.sum(axis=1)
        name = "slot_tokens"
    elif w.has("local_tokens", "received_tokens"):
        computed = local + w.received_tokens.sum(axis=1)
        name = "received_tokens"
    elif w.rank_tokens is not None:
        computed = w.rank_tokens.sum(axis=1)
        name = "rank_tokens"
    if computed is not None and routed is not None:
        if w.dropped_tokens is not None:
            _check_layers(name, computed != kept, f"sum({name}) != sum(expert_tokens) - sum(dropped_tokens)"
                          if name != "received_tokens" else
                          "sum(local_tokens) + sum(received_tokens) != sum(expert_tokens) - sum(dropped_tokens)")
        else:
            _check_layers(name, computed > routed, "more pairs computed than were routed (sum(expert_tokens))")
    if computed is not None and w.has("local_tokens", "sent_tokens"):
        _check_layers("sent_tokens", local + w.sent_tokens.sum(axis=1) != computed,
                      "sum(local_tokens) + sum(sent_tokens) != sum(slot_tokens)")
    if w.has("slot_tokens", "local_tokens", "received_tokens"):
        _check_layers("received_tokens", local + w.received_tokens.sum(axis=1) != computed,
                      "sum(local_tokens) + sum(received_tokens) != sum(slot_tokens)")
        per_rank = w.slot_tokens.reshape(L, W, P // W).sum(axis=2)
        _check_layers("slot_tokens", np.any(per_rank != w.local_tokens + w.received_tokens, axis=1),
                      "a rank's slots do not add up to its local + received pairs")
    if w.extra.get(SHARD_KEY) is not None:
        parse_shard(w.extra[SHARD_KEY], W)
    if w.extra.get(SHARDS_KEY) is not None:
        parse_shards_report(w.extra[SHARDS_KEY])
    if STEP_A2A_KEY in w.extra:
        value = w.extra[STEP_A2A_KEY]
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or value < 0):
            raise WindowError(STEP_A2A_KEY, f"must be a finite number of seconds >= 0, got {value!r}")
    if w.traffic is not None:
        # The matrix holds local, sent and received: a source that has it states them too.
        lacking = [n for n in ("local_tokens", "sent_tokens", "received_tokens") if getattr(w, n) is None]
        if lacking:
            raise WindowError("traffic", f"present while {', '.join(lacking)} absent (the matrix determines them)")
        diag = np.diagonal(w.traffic, axis1=1, axis2=2)
        _check_layers("traffic", np.any(diag != w.local_tokens, axis=1),
                      "the diagonal differs from local_tokens")
        _check_layers("traffic", np.any(w.traffic.sum(axis=2) != w.local_tokens + w.sent_tokens, axis=1),
                      "row sums differ from local + sent")
        _check_layers("traffic", np.any(w.traffic.sum(axis=1) != w.local_tokens + w.received_tokens, axis=1),
                      "column sums differ from local + received")


# A phase of a layer is timed inside it, so it cannot take longer than the layer: beyond this it is a
# broken source, not timer granularity (a clock tick of up to 1 us per step read on each side of a
# phase, and 0.1 % for clocks read on different streams or devices).
PHASE_TIME_ABSOLUTE_SLACK_PER_STEP = 1e-6
PHASE_TIME_RELATIVE_SLACK = 1e-3
PHASE_TIME_FIELDS = ("dispatch_seconds", "combine_seconds", "compute_seconds")


def _check_phase_times(w: Window) -> None:
    """Per layer and rank, no phase time [L, W] exceeds layer_seconds [L, W] beyond the slack."""
    if w.layer_seconds is None:
        return
    limit = (w.layer_seconds * (1.0 + PHASE_TIME_RELATIVE_SLACK)
             + PHASE_TIME_ABSOLUTE_SLACK_PER_STEP * max(w.steps, 1))
    for name in PHASE_TIME_FIELDS:
        phase = getattr(w, name)
        if phase is None:
            continue
        over = phase > limit
        if over.any():
            layer, rank = map(int, np.argwhere(over)[0])
            raise WindowError(f"{name}[{layer}][{rank}]",
                              f"{phase[layer, rank]:.9g} s exceeds the rank's layer_seconds "
                              f"{w.layer_seconds[layer, rank]:.9g} s (a phase is timed inside its layer)")


def _check_wait_times(w: Window) -> None:
    """wait_seconds [L, W] is part of the rank's dispatch + combine (same slack as the phases)."""
    if w.wait_seconds is None:
        return
    if not w.has("dispatch_seconds", "combine_seconds"):
        raise WindowError("wait_seconds", "present without dispatch_seconds and combine_seconds (a wait is "
                                          "part of the all-to-all time)")
    a2a = w.dispatch_seconds + w.combine_seconds
    over = w.wait_seconds > a2a * (1.0 + PHASE_TIME_RELATIVE_SLACK) + PHASE_TIME_ABSOLUTE_SLACK_PER_STEP * max(w.steps, 1)
    if over.any():
        layer, rank = map(int, np.argwhere(over)[0])
        raise WindowError(f"wait_seconds[{layer}][{rank}]",
                          f"{w.wait_seconds[layer, rank]:.9g} s exceeds the rank's dispatch + combine "
                          f"{a2a[layer, rank]:.9g} s")


def a2a_over_bound(a2a_seconds: np.ndarray, bound_seconds: np.ndarray) -> np.ndarray:
    """[L, W] dispatch + combine seconds per rank, [L] bound seconds -> [L] the slowest rank's time over
    the bound (a collective ends when its last rank does); 0 where the bound is 0 (nothing crossed a
    link: there is no bound to be over)."""
    measured = np.asarray(a2a_seconds, dtype=np.float64).max(axis=1)
    bound = np.asarray(bound_seconds, dtype=np.float64)
    out = np.zeros_like(bound)
    np.divide(measured, bound, out=out, where=bound > 0)
    return out


def _check_a2a_bound(w: Window) -> None:
    """a2a_bound_seconds and a2a_over_bound come together, with the phase times the ratio is made of,
    and the ratio is the one those times give (relative 1e-6)."""
    if w.a2a_bound_seconds is None and w.a2a_over_bound is None:
        return
    for name in ("a2a_bound_seconds", "a2a_over_bound"):
        if getattr(w, name) is None:
            other = "a2a_over_bound" if name == "a2a_bound_seconds" else "a2a_bound_seconds"
            raise WindowError(name, f"absent while {other} is present (the two come together)")
    if w.dispatch_seconds is None or w.combine_seconds is None:
        raise WindowError("a2a_over_bound", "present without dispatch_seconds and combine_seconds")
    expected = a2a_over_bound(w.dispatch_seconds + w.combine_seconds, w.a2a_bound_seconds)
    off = ~np.isclose(w.a2a_over_bound, expected, rtol=1e-6, atol=1e-9)
    if off.any():
        layer = int(np.flatnonzero(off)[0])
        raise WindowError(f"a2a_over_bound[{layer}]", f"{w.a2a_over_bound[layer]:.9g} is not the slowest rank's "
                          f"dispatch + combine over a2a_bound_seconds ({expected[layer]:.9g})")


def _check_layers(name: str, bad: np.ndarray, message: str, per_element: bool = False) -> None:
    bad = np.asarray(bad)
    if per_element:
        bad = bad.reshape(bad.shape[0], -1).any(axis=1)
    if bad.any():
        raise WindowError(name, f"layer {int(np.argmax(bad))}: {message}")


# --- binary form -------------------------------------------------------------------------------
# b"MWW1" | u32 header length | header JSON (utf-8) | zero padding to 8 | raw little-endian buffers.
# The header carries scalars, unknown fields and, per array, dtype, shape, offset and length.
BINARY_MAGIC = b"MWW1"
# Counts travel in the narrowest unsigned type holding their maximum (they are never negative);
# times as float64, so the binary form is as exact as the JSON one.
_INT_DTYPES = ("<u1", "<u2", "<u4", "<u8")
_ALLOWED_DTYPES = frozenset({*_INT_DTYPES, "<i8", "<f8"})


def _wire_dtype(kind: str, arr: np.ndarray) -> str:
    if kind == "f":
        return "<f8"
    top = int(arr.max()) if arr.size else 0
    return next(d for d in _INT_DTYPES if top <= np.iinfo(np.dtype(d)).max)


def encode_binary(w: Window) -> bytes:
    arrays: dict[str, dict[str, Any]] = {}
    buffers: list[bytes] = []
    offset = 0
    for name, (kind, _) in ARRAY_FIELDS.items():
        arr = getattr(w, name)
        if arr is None:
            continue
        dtype = _wire_dtype(kind, arr)
        raw = np.ascontiguousarray(arr, dtype=dtype).tobytes()
        arrays[name] = {"dtype": dtype, "shape": list(arr.shape), "offset": offset, "nbytes": len(raw)}
        buffers.append(raw)
        offset += len(raw)
    header = {"schema": w.schema, "arrays": arrays, "extra": dict(w.extra)}
    header.update({name: getattr(w, name) for name in SCALAR_FIELDS})
    head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    pad = (-(len(BINARY_MAGIC) + 4 + len(head))) % 8
    return b"".join([BINARY_MAGIC, struct.pack("<I", len(head)), head, b"\0" * pad, *buffers])


def decode_binary(blob: bytes) -> Window:
    if len(blob) < 8 or blob[:4] != BINARY_MAGIC:
        raise WindowError("<binary>", "not a moewatch binary window (bad magic)")
    (head_len,) = struct.unpack_from("<I", blob, 4)
    if 8 + head_len > len(blob):
        raise WindowError("<binary>", "truncated header")
    try:
        header = json.loads(blob[8:8 + head_len])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise WindowError("<binary>", "header is not valid JSON") from None
    if not isinstance(header, dict) or not isinstance(header.get("arrays"), dict):
        raise WindowError("<binary>", "header lacks an arrays table")
    base = 8 + head_len + ((-(8 + head_len)) % 8)
    data: dict[str, Any] = {k: v for k, v in header.items() if k not in ("arrays", "extra")}
    extra = header.get("extra") or {}
    if not isinstance(extra, dict):
        raise WindowError("<binary>", "extra must be an object")
    for name, spec in header["arrays"].items():
        if not isinstance(spec, dict) or spec.get("dtype") not in _ALLOWED_DTYPES:
            raise WindowError(name, f"array dtype must be one of {sorted(_ALLOWED_DTYPES)}")
        try:
            dtype = np.dtype(spec["dtype"])
            shape = tuple(int(s) for s in spec["shape"])
            start, nbytes = int(spec["offset"]), int(spec["nbytes"])
        except (KeyError, TypeError, ValueError):
            raise WindowError(name, "malformed array descriptor") from None
        if any(s < 0 for s in shape) or start < 0 or nbytes != dtype.itemsize * math.prod(shape):
            raise WindowError(name, "array descriptor does not match its shape")
        if base + start + nbytes > len(blob):
            raise WindowError(name, "truncated array buffer")
        arr = np.frombuffer(blob, dtype=dtype, count=math.prod(shape), offset=base + start).reshape(shape)
        # A newer writer's arrays are kept as plain lists, like unknown JSON fields.
        data[name] = arr if name in ARRAY_FIELDS else arr.tolist()
    for name in ARRAY_FIELDS:
        data.setdefault(name, None)
    for key, value in extra.items():
        data.setdefault(key, value)
    return Window.from_dict(data)


# --- derived quantities (docs/telemetry.md, "What the triage derives") --------------------------------
# Each returns one value per layer: an array of shape [L] unless said otherwise, or None when the
# window lacks the evidence (`Window.missing_evidence` says which). Nothing is estimated in its place.

def _once(fn):
    """Compute a derived quantity once per window and share it (triage, exporters and policy all ask
    for rank load, balancedness, ...): cached on the window, read-only. Windows are immutable, and
    `Window.replace` makes a new one, so a cached value never goes stale."""
    name = fn.__name__

    @functools.wraps(fn)
    def once(w: Window, *args: Any) -> Any:
        cache = w.__dict__.setdefault("_derived", {})
        key = (name, args)
        if key not in cache:
            value = fn(w, *args)
            if isinstance(value, np.ndarray):
                value.setflags(write=False)
            cache[key] = value
        return cache[key]

    return once


def _ratio(num: np.ndarray, den: np.ndarray, empty: float = 0.0) -> np.ndarray:
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    out = np.full(np.broadcast(num, den).shape, empty, dtype=np.float64)
    np.divide(num, den, out=out, where=den > 0)
    return out


@_once
def a2a_seconds(w: Window) -> np.ndarray | None:
    """[L, W] dispatch + combine seconds per rank, summed over the window's steps."""
    if not w.has("dispatch_seconds", "combine_seconds"):
        return None
    return w.dispatch_seconds + w.combine_seconds


def _share_of_layer_time(w: Window, seconds: np.ndarray | None) -> np.ndarray | None:
    """[L] seconds (already summed over ranks) over layer time summed over ranks; None without either."""
    if seconds is None or w.layer_seconds is None:
        return None
    return _ratio(seconds, w.layer_seconds.sum(axis=1))


@_once
def a2a_share(w: Window) -> np.ndarray | None:
    """[L] (dispatch + combine) / layer time, both summed over ranks."""
    a2a = a2a_seconds(w)
    return _share_of_layer_time(w, None if a2a is None else a2a.sum(axis=1))


def step_a2a_seconds(w: Window) -> float | None:
    """The window's all-to-all seconds over all layers (summed over its steps, mean over ranks): the
    per-step total a source carried (`extra.a2a_step_seconds`), else the per-layer dispatch + combine
    summed over layers; None when neither is there."""
    if STEP_A2A_KEY in w.extra:
        return float(w.extra[STEP_A2A_KEY])
    a2a = a2a_seconds(w)
    return None if a2a is None else float(a2a.sum(axis=0).mean())


def a2a_step_share(w: Window) -> float | None:
    """Share of step time spent in all-to-all, all layers together: step_a2a_seconds / sum of
    step_seconds. Per step, not per layer; None without either, or with no step time."""
    a2a = step_a2a_seconds(w)
    if a2a is None or w.step_seconds is None or float(w.step_seconds.sum()) <= 0:
        return None
    return a2a / float(w.step_seconds.sum())


@_once
def rank_load(w: Window) -> np.ndarray | None:
    """[L, W] pairs each rank computed: the sum over its slots, which the contract makes equal to
    local + received and to rank_tokens (each is measured evidence; the first present is used).
    None for a window of logical counts only: the placement and the routed counts alone do not say
    where tokens started, so nothing is invented."""
    if w.slot_tokens is not None:
        return w.slot_tokens.reshape(w.num_layers, w.world_size, w.slots_per_rank).sum(axis=2)
    if w.has("local_tokens", "received_tokens"):
        return w.local_tokens + w.received_tokens
    return w.rank_tokens


@_once
def rank_load_max_min(w: Window) -> np.ndarray | None:
    """[L] max/min of rank load; inf where a rank computed nothing while another did."""
    load = rank_load(w)
    if load is None:
        return None
    hi, lo = load.max(axis=1).astype(np.float64), load.min(axis=1).astype(np.float64)
    out = np.ones(w.num_layers)
    busy = hi > 0
    out[busy] = np.where(lo[busy] > 0, hi[busy] / np.maximum(lo[busy], 1.0), math.inf)
    return out


@_once
def rank_load_max_mean(w: Window) -> np.ndarray | None:
    """[L] max/mean of rank load (1.0 is perfect balance; an idle layer reads 1.0)."""
    load = rank_load(w)
    return None if load is None else _ratio(load.max(axis=1), load.mean(axis=1), empty=1.0)


@_once
def rank_load_cv(w: Window) -> np.ndarray | None:
    """[L] std/mean of rank load (the expert-load-per-card dispersion of [serving-2026])."""
    load = rank_load(w)
    return None if load is None else _ratio(load.std(axis=1), load.mean(axis=1))


@_once
def balancedness(w: Window) -> np.ndarray | None:
    """[L] mean/max of rank load, in (0, 1]; 1.0 for an idle layer (vLLM and SGLang convention)."""
    load = rank_load(w)
    return None if load is None else _ratio(load.mean(axis=1), load.max(axis=1), empty=1.0)


@_once
def expert_load_cv(w: Window) -> np.ndarray | None:
    """[L] std/mean of pairs routed to each logical expert (before capacity); None without expert_tokens."""
    load = w.expert_tokens
    if load is None:
        return None
    return _ratio(load.std(axis=1), load.mean(axis=1))


@_once
def hot_experts(w: Window, multiple: float) -> list[list[int]] | None:
    """Per layer, experts routed more than `multiple` x the mean expert load, hottest first; None
    without expert_tokens (per-rank totals cannot name an expert)."""
    if w.expert_tokens is None:
        return None
    tokens = w.expert_tokens
    mean = tokens.mean(axis=1)
    hot = (tokens > multiple * mean[:, None]) & (mean > 0)[:, None]
    counts = hot.sum(axis=1)
    # All layers in one stable sort: hot experts by load, hottest first (the lower index among equals),
    # the others after them.
    order = np.argsort(np.where(hot, -tokens, np.iinfo(np.int64).max), axis=1, kind="stable")
    return [row[:n] for row, n in zip(order[:, :int(counts.max(initial=0))].tolist(), counts.tolist())]


@_once
def cross_rank_ratio(w: Window) -> np.ndarray | None:
    """[L] share of computed pairs whose slot was on another rank: sent / (local + sent)."""
    if not w.has("local_tokens", "sent_tokens"):
        return None
    sent = w.sent_tokens.sum(axis=1)
    return _ratio(sent, w.local_tokens.sum(axis=1) + sent)


@_once
def kept_tokens(w: Window) -> np.ndarray | None:
    """[L, E] pairs each expert kept after capacity: routed minus dropped, or routed where the
    window cannot see capacity (the measured count, not an estimate of the drops); None without
    expert_tokens."""
    if w.expert_tokens is None:
        return None
    return w.expert_tokens if w.dropped_tokens is None else w.expert_tokens - w.dropped_tokens


@_once
def expected_cross_rank_ratio(w: Window) -> np.ndarray | None:
    """[L] cross-rank ratio the placement predicts for this window's expert load.

    Tokens are assumed to start evenly over ranks and to use a local replica when their rank holds
    one (the runtime's replica policy): expert e stays local with probability (ranks holding e) / W.
    With one replica per expert this is 1 - 1/W whatever the load; replicas lower it. A measured
    ratio well above it means tokens' home ranks and their experts' ranks are anti-correlated.
    A prediction from the placement and the routed counts: None for a window without expert_tokens.
    """
    if w.expert_tokens is None:
        return None
    W = w.world_size
    local_prob = holder_counts(w.physical_to_logical_map, w.num_experts, W) / W  # [L, E]
    kept = kept_tokens(w)
    total = kept.sum(axis=1)
    expected_local = _ratio((kept * local_prob).sum(axis=1), total)
    return np.where(total > 0, 1.0 - expected_local, 1.0 - 1.0 / W)


@_once
def overflow_rate(w: Window) -> np.ndarray | None:
    """[L] (dropped + rerouted) / routed pairs."""
    if not w.has("dropped_tokens", "rerouted_tokens"):
        return None
    return _ratio((w.dropped_tokens + w.rerouted_tokens).sum(axis=1), w.expert_tokens.sum(axis=1))


@_once
def effective_capacity_factor(w: Window) -> np.ndarray | None:
    """[L] computed pairs over the capacity granted, C x k x tokens; NaN where dropless (C = 0).

    [serving-2026] asks for C_eff > 0.8: the share of the capacity buffer doing useful work. A layer
    padded far beyond its load (C = 2 on balanced routing) reads about 0.5. None without step_tokens
    or without the computed pairs (slot_tokens, or routed minus dropped).
    """
    if w.step_tokens is None:
        return None
    if w.slot_tokens is not None:
        computed = w.slot_tokens.sum(axis=1).astype(np.float64)
    elif w.dropped_tokens is not None:
        computed = kept_tokens(w).sum(axis=1).astype(np.float64)
    else:
        return None
    granted = w.capacity_factor * w.top_k * float(w.step_tokens.sum())
    out = np.full(w.num_layers, np.nan)
    np.divide(computed, granted, out=out, where=granted > 0)
    return out


@_once
def a2a_lower_bound_seconds(w: Window, link_bandwidth_bytes_per_s: float) -> np.ndarray | None:
    """[L] Aurora's bound ([aurora]) on dispatch + combine time for the window.

    max over ranks of sent or received pairs x hidden_bytes / bandwidth, once per direction
    (combine moves the same bytes back). Summed over steps, this stays a lower bound because the
    sum of per-step maxima is at least the maximum of the sums.
    """
    if link_bandwidth_bytes_per_s <= 0:
        raise ValueError("link_bandwidth_bytes_per_s must be positive")
    if not w.has("sent_tokens", "received_tokens"):
        return None
    busiest = np.maximum(w.sent_tokens.max(axis=1), w.received_tokens.max(axis=1))
    return 2.0 * busiest * w.hidden_bytes / link_bandwidth_bytes_per_s


@_once
def a2a_measured_seconds(w: Window) -> np.ndarray | None:
    """[L] all-to-all time of the group: the slowest rank's dispatch + combine (a collective ends
    when its last rank does)."""
    a2a = a2a_seconds(w)
    return None if a2a is None else a2a.max(axis=1)


@_once
def a2a_efficiency(w: Window, link_bandwidth_bytes_per_s: float) -> np.ndarray | None:
    """[L] Aurora bound over measured all-to-all time, in [0, 1] (1 = at the bound); the inverse
    of measured-over-bound. NaN where nothing was measured."""
    bound = a2a_lower_bound_seconds(w, link_bandwidth_bytes_per_s)
    measured = a2a_measured_seconds(w)
    if bound is None or measured is None:
        return None
    out = np.full(w.num_layers, np.nan)
    np.divide(bound, measured, out=out, where=measured > 0)
    return np.minimum(out, 1.0, where=~np.isnan(out), out=out)


@_once
def mean_message_bytes(w: Window) -> np.ndarray | None:
    """[L] mean bytes per rank-to-rank message per step and direction (the small-message signal:
    [serving-2026] puts fixed per-message cost in charge below 32 KB)."""
    if w.sent_tokens is None:
        return None
    messages = w.steps * w.world_size * max(w.world_size - 1, 1)
    return _ratio(w.sent_tokens.sum(axis=1) * float(w.hidden_bytes), np.full(w.num_layers, messages))


@_once
def compute_max_mean(w: Window) -> np.ndarray | None:
    """[L] slowest rank's expert compute time over the mean (a hardware straggler at even load)."""
    if w.compute_seconds is None:
        return None
    return _ratio(w.compute_seconds.max(axis=1), w.compute_seconds.mean(axis=1), empty=1.0)


@_once
def pair_seconds_relative(w: Window) -> np.ndarray | None:
    """[L, W] each rank's expert compute seconds per pair in a layer over the median rank's (1.0 a
    typical rank, 1.5 one that takes half as long again per pair): a slow device in one layer, with
    the load taken out (compute time grows with pairs, so raw time max/mean reads a busy rank as a
    slow one). NaN for a rank that computed no pairs, and for every rank of a layer where no rank
    did; None without compute time or rank load."""
    load = rank_load(w)
    if load is None or w.compute_seconds is None:
        return None
    per_pair = np.full(load.shape, np.nan)
    np.divide(w.compute_seconds, load, out=per_pair, where=load > 0)
    out = np.full(load.shape, np.nan)
    timed = np.isfinite(per_pair).any(axis=1)
    if timed.any():
        rows = per_pair[timed]
        # np.median where nothing is missing: the same numbers without nanmedian's masked-array path
        median = (np.median if np.isfinite(rows).all() else np.nanmedian)(rows, axis=1)[:, None]
        ratio = np.full(rows.shape, np.nan)
        np.divide(rows, median, out=ratio, where=median > 0)  # a median rank that took no time: unknown
        out[timed] = ratio
    return out


@_once
def a2a_transfer_seconds(w: Window) -> np.ndarray | None:
    """[L] all-to-all seconds per rank that are transfer, not waiting, summed over the window's steps.

    A synchronous all-to-all ends for every rank when the last one has arrived and sent, so the
    rank that arrives last waits for nobody: its time in the collective is the transfer alone, and
    what any other rank spends beyond it is waiting. Per phase (dispatch, combine) the least time
    over ranks is that rank's; the transfer is the sum of both phases' least. A rank's measured
    waits (DeepEP's per-source wait counters, the `wait_seconds` field) replace the estimate when the
    window carries them: transfer is then each rank's all-to-all less its wait, the least over ranks."""
    if not w.has("dispatch_seconds", "combine_seconds"):
        return None
    measured = w.wait_seconds
    if measured is not None:
        return (a2a_seconds(w) - measured).clip(min=0.0).min(axis=1)
    return w.dispatch_seconds.min(axis=1) + w.combine_seconds.min(axis=1)


@_once
def a2a_wait_seconds(w: Window) -> np.ndarray | None:
    """[L, W] all-to-all seconds each rank spent waiting for a later rank (summed over steps): its
    dispatch + combine less the layer's transfer (a2a_transfer_seconds); measured waits when the
    window carries them."""
    measured = w.wait_seconds
    if measured is not None:
        return np.asarray(measured, dtype=np.float64)
    transfer = a2a_transfer_seconds(w)
    if transfer is None:
        return None
    return (a2a_seconds(w) - transfer[:, None]).clip(min=0.0)


@_once
def a2a_transfer_share(w: Window) -> np.ndarray | None:
    """[L] transfer share of layer time: W x transfer / layer time summed over ranks. Step 1 of the
    triage uses it: waiting for a slow rank is not communication."""
    transfer = a2a_transfer_seconds(w)
    return _share_of_layer_time(w, None if transfer is None else transfer * w.world_size)


@_once
def a2a_wait_share(w: Window) -> np.ndarray | None:
    """[L] wait share of layer time, summed over ranks (a2a_share = transfer share + wait share)."""
    wait = a2a_wait_seconds(w)
    return _share_of_layer_time(w, None if wait is None else wait.sum(axis=1))


@_once
def rank_speed(w: Window) -> np.ndarray | None:
    """[W] pairs each rank computed per second of expert compute, all layers together (a rank's
    speed, the planner's `rank_speed`); NaN for a rank that computed nothing or timed nothing. None
    without compute time or rank load."""
    load = rank_load(w)
    if load is None or w.compute_seconds is None:
        return None
    pairs = load.sum(axis=0).astype(np.float64)
    seconds = w.compute_seconds.sum(axis=0)
    out = np.full(w.world_size, np.nan)
    np.divide(pairs, seconds, out=out, where=(seconds > 0) & (pairs > 0))
    return out


@_once
def relative_rank_speed(w: Window) -> np.ndarray | None:
    """[W] each rank's speed (rank_speed, all layers) over the median rank's: 1.0 is a typical rank,
    0.5 one that computes half as many pairs per second. NaN where the speed is unknown; None without
    compute time or rank load, or when no rank has a speed."""
    speed = rank_speed(w)
    if speed is None or not np.isfinite(speed).any():
        return None
    return speed / np.nanmedian(speed)


@_once
def time_balancedness(w: Window) -> np.ndarray | None:
    """[L] mean/max of each rank's expert compute time, in (0, 1]: balancedness by time, not pairs
    (a plan in proportion to rank speed lowers plain balancedness and raises this); 1.0 for a layer
    that computed nothing."""
    if w.compute_seconds is None:
        return None
    return _ratio(w.compute_seconds.mean(axis=1), w.compute_seconds.max(axis=1), empty=1.0)


@_once
def per_step_max(w: Window, name: str) -> np.ndarray | None:
    """[L] the slowest rank's value of an [L, W] time field per step, or None when it is absent."""
    value = getattr(w, name)
    return None if value is None else value.max(axis=1) / max(w.steps, 1)
