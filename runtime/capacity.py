"""Capacity per expert, enforced on one rank's pairs before dispatch, with exact accounting.

Capacity is ceil(C * N * k / E) pairs per logical expert, N being the rank's real (non-padding) tokens
in the step (the core's moewatch.capacity.expert_capacity works it out): the rule GShard and DeepSpeed
apply per device, here per rank. An expert's capacity is
shared by all its replicas (it is a property of the logical expert, not of a slot). C = 0 is dropless.

Which pairs keep their place: first choices before second choices, then token order. The overflow
policy decides the rest:
- `drop`: the pair is not computed and contributes zero; counted at its expert in `dropped`.
- `reroute`: the pair moves to the token's next-best expert (by router score, never one the token
  already uses) that still has room, in rounds: each round every token with a pair still waiting
  proposes its next candidate, and candidates accept proposals in token order while room lasts.
  A moved pair is counted at the expert it left in `rerouted` and is computed by the new expert;
  a pair that finds no room anywhere is dropped and counted in `dropped`, not in `rerouted`.

So for every expert: routed = kept + rerouted + dropped, and every pair is exactly one of computed
(kept or moved) or dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class CapacityAssignment:
    assigned: torch.Tensor  # [N, k] expert that computes each pair; -1 dropped or padding
    routed: torch.Tensor  # [E] pairs routed to each expert before capacity (padding excluded)
    dropped: torch.Tensor  # [E] pairs dropped, at the expert they were routed to
    rerouted: torch.Tensor  # [E] pairs moved off each expert to another one


def group_ordinal(keys: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[M] position of each element among the elements with the same key, counted in index order.

    keys [M] integers in [0, num_groups). Example: keys [2, 0, 2, 2, 0] -> [0, 0, 1, 2, 1].
    """
    if keys.numel() == 0:
        return torch.zeros_like(keys)
    sorted_keys, order = torch.sort(keys, stable=True)
    counts = torch.bincount(keys, minlength=num_groups)
    starts = torch.cumsum(counts, 0) - counts
    ordinal_sorted = torch.arange(keys.numel(), device=keys.device) - starts[sorted_keys]
    out = torch.empty_like(keys)
    out[order] = ordinal_sorted
    return out


def apply_capacity(ids: torch.Tensor, valid: torch.Tensor, scores: torch.Tensor, capacity: int | None,
                   overflow: str) -> CapacityAssignment:
    """Capacity on one rank's pairs.

    ids [N, k] chosen experts (distinct per token, best first), valid [N] bool (False = padding),
    scores [N, E] router scores (rank the alternatives for `reroute`), capacity per expert or None.
    """
    num_tokens, top_k = ids.shape
    num_experts = scores.shape[1]
    ids = ids.long()
    valid_pairs = valid.bool()[:, None].expand(num_tokens, top_k)
    routed = torch.bincount(ids[valid_pairs], minlength=num_experts)
    zeros = torch.zeros_like(routed)
    if capacity is None:
        return CapacityAssignment(torch.where(valid_pairs, ids, -1), routed, zeros, zeros.clone())

    # Priority order: choice j major, token minor -> flat index j * N + t.
    flat_ids = ids.t().reshape(-1)
    flat_valid = valid_pairs.t().reshape(-1)
    keys = torch.where(flat_valid, flat_ids, num_experts)  # padding in a bucket of its own
    position = group_ordinal(keys, num_experts + 1)
    keep = (flat_valid & (position < capacity)).reshape(top_k, num_tokens).t()
    over = valid_pairs & ~keep
    assigned = torch.where(keep, ids, -1)
    rerouted = zeros.clone()
    if overflow == "reroute" and bool(over.any()):
        room = capacity - torch.bincount(ids[keep], minlength=num_experts)
        rerouted = _reroute(ids, scores, assigned, over, room)
    dropped = torch.bincount(ids[over], minlength=num_experts)
    return CapacityAssignment(assigned, routed, dropped, rerouted)


def _reroute(ids: torch.Tensor, scores: torch.Tensor, assigned: torch.Tensor, pending: torch.Tensor,
             room: torch.Tensor) -> torch.Tensor:
    """Move pending pairs to next-best experts with room, in rounds; updates assigned and pending in
    place (what stays pending is dropped). Returns rerouted [E] counted at the experts pairs left."""
    num_tokens, top_k = ids.shape
    num_experts = scores.shape[1]
    rerouted = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
    num_candidates = num_experts - top_k
    if num_candidates == 0:
        return rerouted
    own = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, ids, True)
    ranked = torch.sort(scores.float().masked_fill(own, -math.inf), dim=1, descending=True, stable=True).indices
    candidates = ranked[:, :num_candidates]  # [N, E - k]: never an expert the token already chose
    pointer = torch.zeros(num_tokens, dtype=torch.long, device=ids.device)
    while True:
        tokens = torch.nonzero(pending.any(dim=1) & (pointer < num_candidates)).squeeze(1)
        if tokens.numel() == 0 or int(room.sum()) == 0:
            break
        choice = pending[tokens].int().argmax(dim=1)  # the token's first pair still waiting
        expert = candidates[tokens, pointer[tokens]]
        accepted = group_ordinal(expert, num_experts) < room[expert]
        tok, j, new = tokens[accepted], choice[accepted], expert[accepted]
        assigned[tok, j] = new
        pending[tok, j] = False
        rerouted += torch.bincount(ids[tok, j], minlength=num_experts)
        room -= torch.bincount(new, minlength=num_experts)
        pointer[tokens] += 1
    return rerouted
