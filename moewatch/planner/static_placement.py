"""A recorded placement served statically by an engine's rebalancing.

With MOEWATCH_EPLB=1 and MOEWATCH_EPLB_PLACEMENT=FILE, moewatch's policy inside the engine answers
every rebalance call with FILE's physical_to_logical_map [L, P] instead of planning one: the placement
`moewatch plan --load WINDOWS --slots P` solved once from the operator's recorded traffic, kept from
then on (the first call moves the engine to it, every later call returns it unchanged, so nothing
moves again). FILE is a plan `moewatch plan` writes: moewatch JSON or SGLang's `--init-expert-location`
JSON (SGLang loads that file itself at start, so the adapter there needs none of this).

Checked twice, each where it can be: the file when the adapter installs the policy (unreadable or
not a plan: the variable is named and the engine's own policy stays), its shape on each call, against
the sizes the engine passes (known only then; a mismatch names what differs and the engine's own
policy answers).

Sizes: L layers, E logical experts, P physical slots, W ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .files import FileFormatError, read_plan
from .placement_math import placement_balancedness
from .rebalance import (STATIC_KEPT, STATIC_PLACED, RebalanceDecision, RebalanceSettings, layer_gain_and_stall,
                        usable_current)

PLACEMENT_VARIABLE = "MOEWATCH_EPLB_PLACEMENT"


@dataclass(frozen=True, eq=False)
class StaticPlacement:
    """The placement file's map, read once per process."""

    path: str
    physical_to_logical_map: np.ndarray  # [L, P] int64, read-only

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "StaticPlacement | None":
        """The placement MOEWATCH_EPLB_PLACEMENT names, or None when it is unset or empty; raises
        ValueError naming the variable when the file cannot be read as a plan."""
        path = environ.get(PLACEMENT_VARIABLE, "").strip()
        if not path:
            return None
        try:
            plan = read_plan(path)
        except FileFormatError as exc:
            raise ValueError(f"{PLACEMENT_VARIABLE}: {exc}") from None
        return cls(path, plan.physical_to_logical_map)

    @property
    def shape(self) -> tuple[int, int]:
        layers, slots = self.physical_to_logical_map.shape
        return int(layers), int(slots)

    def mismatch(self, num_layers: int, num_experts: int, num_slots: int, num_ranks: int) -> str | None:
        """What in the file differs from the engine's sizes, in words naming both sides, or None when
        the engine can run it: L layers, P slots divisible over the ranks, every entry a logical expert
        and every expert in at least one slot of each layer."""
        pmap = self.physical_to_logical_map
        layers, slots = self.shape
        differs = []
        if layers != num_layers:
            differs.append(f"{layers} layers where the engine has {num_layers} MoE layers")
        if slots != num_slots:
            differs.append(f"{slots} slots where the engine has {num_slots} physical experts")
        elif num_ranks > 0 and slots % num_ranks:
            differs.append(f"{slots} slots that do not divide over the engine's {num_ranks} ranks")
        if int(pmap.max()) >= num_experts:
            differs.append(f"expert id {int(pmap.max())} where the engine has {num_experts} logical experts")
        elif not differs:
            held = np.zeros((layers, num_experts), dtype=bool)
            held[np.arange(layers)[:, None], pmap] = True
            if not held.all():
                layer, expert = map(int, np.argwhere(~held)[0])
                differs.append(f"layer {layer} gives logical expert {expert} of the engine's {num_experts} no slot")
        if not differs:
            return None
        return f"{PLACEMENT_VARIABLE} ({self.path}) holds " + "; ".join(differs)

    def record(self) -> dict[str, Any]:
        """What a decision record says of the placement it served."""
        layers, slots = self.shape
        return {"static_placement": {"path": self.path, "layers": layers, "slots": slots}}


def static_decision(placement: StaticPlacement, load: Any, current: Any, num_gpus: int, num_nodes: int = 1,
                    settings: RebalanceSettings = RebalanceSettings()) -> RebalanceDecision:
    """[L, E] load, [L, P] map in force (None or unusable: placed afresh) -> the decision that serves
    the placement: its map, STATIC_PLACED for a layer whose row changes and STATIC_KEPT for one already
    in force, with balancedness under the load before and after and the predicted gain and stall of
    the change (priced as gated_rebalance prices its own, never gating it). The caller has checked the
    shapes (StaticPlacement.mismatch)."""
    started = time.perf_counter()
    load_arr = np.asarray(load, dtype=np.float64)
    pmap = np.array(placement.physical_to_logical_map, dtype=np.int64)
    L, E = load_arr.shape
    P = pmap.shape[1]
    balancedness = placement_balancedness(load_arr, pmap, num_gpus)
    cur = usable_current(current, L, E, P, num_gpus)
    if cur is None:
        return RebalanceDecision(pmap, (STATIC_PLACED,) * L, None, balancedness, balancedness, np.full(L, P),
                                 np.zeros(L), np.zeros(L), time.perf_counter() - started)
    moved = (pmap != cur).sum(axis=1)
    reasons = tuple(STATIC_PLACED if moved[layer] else STATIC_KEPT for layer in range(L))
    gain, stall = layer_gain_and_stall(load_arr, cur, pmap, num_gpus, num_nodes, settings)
    return RebalanceDecision(pmap, reasons, placement_balancedness(load_arr, cur, num_gpus), balancedness,
                             balancedness, moved, gain, stall, time.perf_counter() - started)
