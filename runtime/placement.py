"""Placement: which logical expert each physical slot holds, which replica a pair goes to, and which
weights a new placement has to move.

Sizes: L layers, E logical experts, P physical slots, W ranks; slot s lives on rank s // (P // W).

Replica choice (the stated policy): a pair whose expert has several replicas goes to a replica on the
token's own rank if there is one, else to one on the token's node, else to any; among the replicas of
that tier, pairs are spread evenly: the j-th pair of expert e on rank r (in pair order) takes
candidate (j + r) mod n, so ranks start their round-robin at different replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .capacity import group_ordinal


def default_placement(num_layers: int, num_experts: int, num_slots: int) -> np.ndarray:
    """[L, P] slot s holds expert s mod E: the first P - E experts get a second replica."""
    return np.tile(np.arange(num_slots, dtype=np.int64) % num_experts, (num_layers, 1))


def slot_ranks(num_slots: int, world_size: int) -> np.ndarray:
    """[P] rank holding each slot."""
    return np.arange(num_slots) // (num_slots // world_size)


@dataclass
class ReplicaTable:
    """Per source rank and expert, the slots its pairs may go to (the policy's tier)."""

    candidates: torch.Tensor  # [W, E, R] slot ids, padded with -1
    counts: torch.Tensor  # [W, E] number of candidates

    def to(self, device: torch.device | str) -> "ReplicaTable":
        return ReplicaTable(self.candidates.to(device), self.counts.to(device))


def replica_candidates(pmap_row: np.ndarray, world_size: int, ranks_per_node: int,
                       num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Candidate slots per (rank, expert) under the policy for one layer.

    pmap_row [P] -> candidates [W, E, R] (padded with -1), counts [W, E].
    """
    pmap_row = np.asarray(pmap_row, dtype=np.int64)
    owner = slot_ranks(pmap_row.shape[0], world_size)
    node = owner // ranks_per_node
    per_pair: list[list[np.ndarray]] = []
    for rank in range(world_size):
        row = []
        for expert in range(num_experts):
            holders = np.flatnonzero(pmap_row == expert)
            own = holders[owner[holders] == rank]
            near = holders[node[holders] == rank // ranks_per_node]
            row.append(own if own.size else near if near.size else holders)
        per_pair.append(row)
    width = max(1, max(c.size for row in per_pair for c in row))
    candidates = np.full((world_size, num_experts, width), -1, dtype=np.int64)
    counts = np.zeros((world_size, num_experts), dtype=np.int64)
    for rank, row in enumerate(per_pair):
        for expert, slots in enumerate(row):
            candidates[rank, expert, :slots.size] = slots
            counts[rank, expert] = slots.size
    return candidates, counts


def replica_table(pmap_row: np.ndarray, world_size: int, ranks_per_node: int, num_experts: int,
                  device: torch.device | str = "cpu") -> ReplicaTable:
    candidates, counts = replica_candidates(pmap_row, world_size, ranks_per_node, num_experts)
    return ReplicaTable(torch.from_numpy(candidates).to(device), torch.from_numpy(counts).to(device))


def choose_slots(experts: torch.Tensor, rank: int, table: ReplicaTable) -> torch.Tensor:
    """[M] the slot computing each pair; experts [M] logical ids of one rank's pairs, in pair order."""
    num_experts = table.counts.shape[1]
    ordinal = group_ordinal(experts, num_experts)
    choice = (ordinal + rank) % table.counts[rank][experts]
    return table.candidates[rank][experts, choice]


@dataclass(frozen=True)
class Transfer:
    """Expert weights one slot of the new placement needs: copy `expert` from `src_slot` (a slot of
    `src_rank` that holds it in the old placement) into `dst_slot`."""

    layer: int
    dst_slot: int
    expert: int
    src_rank: int
    src_slot: int


def plan_migration(old_map: np.ndarray, new_map: np.ndarray, world_size: int) -> list[Transfer]:
    """The copies that turn old_map [L, P] into new_map [L, P]; unchanged slots copy nothing.

    A slot whose rank already holds the expert copies locally; otherwise the expert comes from the
    holder that has been asked for the fewest copies so far in that layer (ties: lowest rank), which
    spreads the sending over replicas.
    """
    old_map = np.asarray(old_map, dtype=np.int64)
    new_map = np.asarray(new_map, dtype=np.int64)
    owner = slot_ranks(old_map.shape[1], world_size)
    transfers = []
    for layer in range(old_map.shape[0]):
        sends = np.zeros(world_size, dtype=np.int64)
        for slot in np.flatnonzero(old_map[layer] != new_map[layer]):
            expert = int(new_map[layer, slot])
            holders = np.flatnonzero(old_map[layer] == expert)
            dst_rank = int(owner[slot])
            local = holders[owner[holders] == dst_rank]
            if local.size:
                src_slot = int(local[0])
            else:
                holder_ranks = owner[holders]
                best = holders[np.lexsort((holder_ranks, sends[holder_ranks]))[0]]
                src_slot = int(best)
                sends[owner[src_slot]] += 1
            transfers.append(Transfer(layer, int(slot), expert, int(owner[src_slot]), src_slot))
    return transfers


def changed_layers(old_map: np.ndarray, new_map: np.ndarray) -> list[int]:
    return [int(layer) for layer in np.flatnonzero(np.any(np.asarray(old_map) != np.asarray(new_map), axis=1))]
