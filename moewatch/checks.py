"""Size and placement rules, one function per rule, shared by every reader of sizes and maps: the
Window reader, the Plan, the planner, the agent's hello check and plan check.

Each rule raises `error(field, message)`, the caller's own InputError subclass (WindowError,
PlanError, PlacementShapeError...), naming the field at fault. Sizes: L layers, E experts, P slots,
W ranks (GPUs).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from .errors import InputError

MAP = "physical_to_logical_map"


def check_at_least_one(sizes: Iterable[tuple[str, int]], error: type[InputError] = InputError) -> None:
    """Every (name, value) is at least 1."""
    for name, value in sizes:
        if value < 1:
            raise error(name, f"{value} must be at least 1")


def check_slots_hold_experts(num_slots: int, num_experts: int, error: type[InputError] = InputError,
                             field: str = "num_slots") -> None:
    """P >= E: every expert needs a slot."""
    if num_slots < num_experts:
        raise error(field, f"{num_slots} slots cannot hold {num_experts} experts")


def check_slots_divide(num_slots: int, num_ranks: int, error: type[InputError] = InputError,
                       field: str = "num_slots", ranks: str = "ranks") -> None:
    """W divides P: every rank holds the same number of slots."""
    if num_slots % num_ranks:
        raise error(field, f"{num_slots} slots do not divide over {num_ranks} {ranks}")


def check_ranks_per_node(num_ranks: int, ranks_per_node: int, error: type[InputError] = InputError,
                         field: str = "ranks_per_node") -> None:
    """Nodes of ranks_per_node ranks partition the W ranks (a node wider than the group is one node)."""
    if ranks_per_node and ranks_per_node < num_ranks and num_ranks % ranks_per_node:
        raise error(field, f"{num_ranks} ranks do not split into nodes of {ranks_per_node}")


def check_num_nodes(num_ranks: int, num_nodes: int, error: type[InputError] = InputError,
                    field: str = "num_nodes", ranks: str = "GPUs") -> None:
    """N divides W: every node holds the same number of ranks."""
    if num_nodes < 1 or num_ranks % num_nodes:
        raise error(field, f"{num_nodes} nodes do not divide {num_ranks} {ranks}")


def check_map_shape(pmap: np.ndarray, num_layers: int, num_slots: int, error: type[InputError] = InputError,
                    field: str = MAP) -> None:
    """pmap is [L, P]."""
    if np.shape(pmap) != (num_layers, num_slots):
        raise error(field, f"shape {list(np.shape(pmap))} does not match [{num_layers}, {num_slots}]")


def check_placement(pmap: np.ndarray, num_experts: int, error: type[InputError] = InputError,
                    field: str = MAP) -> None:
    """Every entry of pmap [L, P] is an expert in [0, E), and every expert has at least one slot."""
    pmap = np.asarray(pmap)
    outside = (pmap < 0) | (pmap >= num_experts)
    if np.any(outside):
        layer, slot = map(int, np.argwhere(outside)[0])
        raise error(field, f"layer {layer} slot {slot}: expert {int(pmap[layer, slot])} outside [0, {num_experts})")
    held = np.zeros((pmap.shape[0], num_experts), dtype=bool)
    np.put_along_axis(held, pmap, True, axis=1)
    if not held.all():
        layer, expert = map(int, np.argwhere(~held)[0])
        raise error(field, f"layer {layer}: expert {expert} has no slot")


def is_valid_placement(pmap: np.ndarray, num_experts: int, num_gpus: int) -> bool:
    """True when pmap is [L, P] with W dividing P, every entry an expert and every expert placed."""
    pmap = np.asarray(pmap)
    if pmap.ndim != 2:
        return False
    try:
        check_slots_divide(pmap.shape[1], num_gpus)
        check_placement(pmap, num_experts)
    except InputError:
        return False
    return True
