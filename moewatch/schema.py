"""The Window's JSON Schema, derived from the field tables in telemetry.py.

The schema describes shape and types; the cross-field invariants (sums, map coverage) are beyond
JSON Schema and live in `telemetry.validate`. Measured fields (telemetry.OPTIONAL_ARRAYS) may be
null or absent: a source leaves out what it cannot measure. The committed copy, moewatch/schemas/window.v1.json,
is checked against this function by the tests, so the two cannot drift.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from .telemetry import ARRAY_FIELDS, OPTIONAL_ARRAYS, REQUIRED_UNLESS, SCALAR_FIELDS, SCHEMA, SHARD_KEY, SHARDS_KEY

_MEANING = {
    "runtime": "runtime that produced the window: moewatch-runtime, sglang, vllm, ...",
    "model": "model identity (a metric label)",
    "ep_group": "expert-parallel group identity (a metric label)",
    "world_size": "W, ranks in the EP group",
    "ranks_per_node": "ranks sharing a fast interconnect",
    "num_layers": "L, MoE layers",
    "num_experts": "E, logical experts per layer",
    "num_slots": "P, physical expert slots per layer (P >= E, P divisible by W); slot s lives on rank s // (P / W)",
    "top_k": "experts chosen per token",
    "epoch": "placement generation in force for the whole window",
    "steps": "forward steps in the window",
    "start_time": "window start, unix seconds",
    "end_time": "window end, unix seconds",
    "hidden_bytes": "bytes one pair moves on the wire each way (hidden size x element size)",
    "physical_to_logical_map": "logical expert held by each slot [L][P]",
    "expert_tokens": "pairs routed to each logical expert, before capacity [L][E]",
    "slot_tokens": "pairs each slot computed, after capacity [L][P]",
    "dropped_tokens": "pairs dropped by capacity [L][E]",
    "rerouted_tokens": "pairs moved off each expert to another by capacity [L][E]",
    "capacity_factor": "capacity factor in force per layer; 0 means dropless [L]",
    "local_tokens": "pairs whose slot is on the token's own rank [L][W]",
    "sent_tokens": "pairs each rank sent to other ranks (dispatch) [L][W]",
    "received_tokens": "pairs each rank received from other ranks [L][W]",
    "traffic": "pairs from rank i to rank j [L][W][W]",
    "dispatch_seconds": "dispatch all-to-all seconds per rank, summed over steps [L][W]",
    "combine_seconds": "combine all-to-all seconds per rank, summed over steps [L][W]",
    "compute_seconds": "expert compute seconds per rank, summed over steps [L][W]",
    "layer_seconds": "whole-layer seconds per rank, summed over steps [L][W]",
    "step_seconds": "wall time of each forward step [steps]",
    "step_tokens": "tokens in each step's batch [steps]",
    "rank_tokens": "pairs each rank computed [L][W] (v1 extension: per-rank totals, for a source that "
                   "sees no per-expert counts)",
    "wait_seconds": "all-to-all seconds each rank spent waiting for later ranks, part of dispatch + combine, "
                    "summed over steps [L][W] (v1 extension: a source that measures its waits)",
    "a2a_bound_seconds": "Aurora's all-to-all bound per layer at the links' known rates, dispatch + combine, "
                         "summed over steps [L] (v1 extension: a source that knows its link rates)",
    "a2a_over_bound": "the slowest rank's dispatch + combine over a2a_bound_seconds [L]; 0 where the bound is 0 "
                      "(v1 extension, with a2a_bound_seconds)",
}



def _array_schema(kind: str, depth: int) -> dict[str, Any]:
    leaf: dict[str, Any] = {"type": "integer", "minimum": 0} if kind == "i" else {"type": "number", "minimum": 0}
    for _ in range(depth):
        leaf = {"type": "array", "items": leaf}
    return leaf


def window_schema() -> dict[str, Any]:
    props: dict[str, Any] = {"schema": {"const": SCHEMA, "description": "version tag"}}
    for name, typ in SCALAR_FIELDS.items():
        spec: dict[str, Any] = {str: {"type": "string"}, int: {"type": "integer", "minimum": 0},
                                float: {"type": "number", "minimum": 0}}[typ]
        props[name] = {**spec, "description": _MEANING[name]}
    for name, (kind, dims) in ARRAY_FIELDS.items():
        spec = _array_schema(kind, len(dims))
        meaning = _MEANING[name]
        if name in OPTIONAL_ARRAYS or name in REQUIRED_UNLESS:
            # Absent evidence: null (or left out) when the source cannot measure it, never a guess.
            spec = {"oneOf": [spec, {"type": "null"}]}
            meaning += (f"; null or absent only when {REQUIRED_UNLESS[name]} is present" if name in REQUIRED_UNLESS
                        else "; null or absent when the source cannot measure it")
        props[name] = {**spec, "description": meaning}
    for name in ("world_size", "num_layers", "num_experts", "num_slots", "top_k", "ranks_per_node"):
        props[name]["minimum"] = 1
    # Shards (docs/telemetry.md, "Shards"): ranges against count and world_size are checked by moewatch.
    count = {"type": "integer", "minimum": 0}
    props[SHARD_KEY] = {
        "type": "object", "required": ["index", "count", "rank", "sequence"],
        "properties": {"index": {**count, "description": "which shard of the group's window, in [0, count)"},
                       "count": {"type": "integer", "minimum": 1,
                                 "description": "shards that make one whole window of the group"},
                       "rank": {**count, "description": "EP rank whose tokens this shard routed, in [0, world_size)"},
                       "sequence": {**count, "description": "window sequence all shards of one window share"}},
        "description": "this window is one shard of its EP group's window (a process routing a share of the "
                       "group's tokens); absent for a whole window"}
    indices = {"type": "array", "items": count}
    props[SHARDS_KEY] = {
        "type": "object", "required": ["count", "received"],
        "properties": {"count": {"type": "integer", "minimum": 1}, "received": indices, "missing": indices,
                       "refused": indices},
        "description": "a window the agent merged from shards: shard indices merged, missing at the deadline, "
                       "and refused (disagreeing on sizes, map or epoch)"}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://moewatch.dev/schemas/window.v1.json",
        "title": "moewatch Window v1",
        "description": "One sampling window of one EP group, aggregated over its ranks. Unknown fields are "
                       "allowed and ignored by readers; cross-field invariants are checked by moewatch.",
        "type": "object",
        "required": ["schema", *SCALAR_FIELDS,
                     *(n for n in ARRAY_FIELDS if n not in OPTIONAL_ARRAYS and n not in REQUIRED_UNLESS)],
        "properties": props,
        # A field required unless another stands in: one of the two is an array.
        "allOf": [{"anyOf": [{"required": [n], "properties": {n: {"type": "array"}}} for n in pair]}
                  for pair in REQUIRED_UNLESS.items()],
        "additionalProperties": True,
    }


def packaged_schema() -> dict[str, Any]:
    """The schema file shipped inside the package."""
    return json.loads(resources.files("moewatch").joinpath("schemas/window.v1.json").read_text())


if __name__ == "__main__":
    print(json.dumps(window_schema(), indent=2))
