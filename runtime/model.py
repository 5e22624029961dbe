"""The MoE model: L layers of (RMS norm -> router top-k -> SwiGLU experts -> weighted sum + residual).

Weights are a pure function of (seed, layer, expert), so every rank builds exactly the experts its
slots hold, a migrated expert can be checked bit for bit against a fresh copy, and a single-process
reference of the same model (`reference_forward`) needs nothing from the EP group.

Sizes in docstrings: N tokens, d hidden, f ffn, E experts, k top-k, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from moewatch.capacity import expert_capacity

from .capacity import apply_capacity


@dataclass(frozen=True)
class ModelSpec:
    num_layers: int
    num_experts: int
    hidden: int
    ffn: int
    top_k: int
    score: str = "softmax"  # "softmax" or "sigmoid"
    seed: int = 0

    @classmethod
    def from_config(cls, cfg) -> "ModelSpec":
        return cls(cfg.layers, cfg.experts, cfg.hidden, cfg.ffn, cfg.top_k, cfg.score, cfg.seed)


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps); the same in every process."""
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state ^ (int(part) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state = (state ^ (state >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return state >> 1


def _generator(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(mix_seed(*parts))


# Tags keep the random streams of different tensors apart.
_ROUTER, _EXPERT, _INPUT = 1, 2, 3


def init_router(spec: ModelSpec, layer: int) -> torch.Tensor:
    """[d, E] router weight of one layer (float32, CPU)."""
    g = _generator(spec.seed, _ROUTER, layer)
    return torch.randn(spec.hidden, spec.num_experts, generator=g) / spec.hidden ** 0.5


def init_expert(spec: ModelSpec, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's SwiGLU weights: w13 [d, 2f] (gate | up) and w2 [f, d] (float32, CPU)."""
    g = _generator(spec.seed, _EXPERT, layer, expert)
    w13 = torch.randn(spec.hidden, 2 * spec.ffn, generator=g) / spec.hidden ** 0.5
    w2 = torch.randn(spec.ffn, spec.hidden, generator=g) / spec.ffn ** 0.5
    return w13, w2


def init_experts(spec: ModelSpec, layer: int, experts: Sequence[int], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked weights of `experts` (logical ids, repeats allowed): w13 [n, d, 2f], w2 [n, f, d]."""
    pairs = [init_expert(spec, layer, int(e)) for e in experts]
    if not pairs:
        return (torch.empty(0, spec.hidden, 2 * spec.ffn, device=device, dtype=dtype),
                torch.empty(0, spec.ffn, spec.hidden, device=device, dtype=dtype))
    w13 = torch.stack([p[0] for p in pairs]).to(device=device, dtype=dtype)
    w2 = torch.stack([p[1] for p in pairs]).to(device=device, dtype=dtype)
    return w13, w2


def input_batch(seed: int, step: int, rank: int, num_tokens: int, hidden: int) -> torch.Tensor:
    """[N, d] the hidden states entering layer 0 for one rank's batch at one step (float32, CPU)."""
    return torch.randn(num_tokens, hidden, generator=_generator(seed, _INPUT, step, rank))


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + eps).to(x.dtype)


def router_scores(x_norm: torch.Tensor, w_router: torch.Tensor, score: str) -> torch.Tensor:
    """[N, E] per-expert scores in float32: softmax over experts, or an independent sigmoid each."""
    logits = x_norm.float() @ w_router.float()
    return torch.softmax(logits, dim=-1) if score == "softmax" else torch.sigmoid(logits)


def select_topk(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """[N, k] the k best experts per token, best first."""
    return torch.topk(scores, top_k, dim=-1, sorted=True).indices


def gate_weights(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[N, k] combine weights: the chosen experts' scores renormalised to sum to one per token.

    Used for learned and synthetic routing alike, so a replayed routing still weights experts by what
    the router thinks of them.
    """
    chosen = torch.gather(scores, 1, ids)
    return chosen / chosen.sum(dim=1, keepdim=True).clamp_min(1e-20)


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert on rows x [n, d]: (silu(x @ W1) * (x @ W3)) @ W2 -> [n, d]."""
    gate_up = x @ w13
    f = w2.shape[0]
    return (torch.nn.functional.silu(gate_up[:, :f]) * gate_up[:, f:]) @ w2


@dataclass
class LayerRouting:
    """What routing decided for one rank's batch at one layer (all [N, k] unless said otherwise)."""

    ids: torch.Tensor  # experts chosen before capacity
    weights: torch.Tensor  # combine weights
    assigned: torch.Tensor  # expert that computes each pair after capacity, -1 when dropped or padding
    scores: torch.Tensor  # [N, E] router scores (ranking for rerouting)


def route_layer(x_norm: torch.Tensor, valid: torch.Tensor, w_router: torch.Tensor, spec: ModelSpec,
                forced_ids: torch.Tensor | None, capacity_factor: float, overflow: str,
                num_real: int | None = None):
    """Routing for one layer: scores, top-k (or the workload's ids), gate weights, capacity.

    Returns (LayerRouting, CapacityAssignment). Padding tokens (valid False) get no pairs; num_real is
    their complement's size when the caller already knows it.
    """
    scores = router_scores(x_norm, w_router, spec.score)
    ids = select_topk(scores, spec.top_k) if forced_ids is None else forced_ids.to(scores.device)
    weights = gate_weights(scores, ids).to(x_norm.dtype)
    if num_real is None:
        num_real = int(valid.sum())
    cap = expert_capacity(capacity_factor, num_real, spec.top_k, spec.num_experts)
    result = apply_capacity(ids, valid, scores, cap, overflow)
    return LayerRouting(ids, weights, result.assigned, scores), result


def combine_pairs(x: torch.Tensor, weights: torch.Tensor, pair_outputs: torch.Tensor) -> torch.Tensor:
    """Residual plus weighted expert outputs: x [N, d] + sum_j weights[:, j] * pair_outputs[:, j].

    pair_outputs [N, k, d] holds zeros for dropped and padding pairs. Summing over j in a fixed order
    keeps the result independent of which slot or rank computed a pair.
    """
    out = x.clone()
    for j in range(weights.shape[1]):
        out += weights[:, j:j + 1] * pair_outputs[:, j]
    return out


def reference_forward(spec: ModelSpec, x: torch.Tensor, valid: torch.Tensor,
                      forced_ids: torch.Tensor | None = None,
                      capacity_factors: Sequence[float] | None = None, overflow: str = "drop",
                      weights_of: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
                      ) -> tuple[torch.Tensor, list[LayerRouting]]:
    """The whole model in one process on one rank's batch, every expert local.

    x [N, d], valid [N] bool, forced_ids [N, L, k] or None (learned routing). Capacity, like in the
    runtime, applies to this batch alone. weights_of(layer) -> (router [d, E], w13 [E, d, 2f],
    w2 [E, f, d]); by default built from the spec. Returns the output [N, d] and each layer's routing.
    """
    caps = list(capacity_factors) if capacity_factors is not None else [0.0] * spec.num_layers
    routings = []
    for layer in range(spec.num_layers):
        if weights_of is None:
            w_router = init_router(spec, layer)
            w13, w2 = init_experts(spec, layer, range(spec.num_experts))
        else:
            w_router, w13, w2 = weights_of(layer)
        x_norm = rms_norm(x)
        forced = None if forced_ids is None else forced_ids[:, layer]
        routing, _ = route_layer(x_norm, valid, w_router, spec, forced, caps[layer], overflow)
        pair_outputs = torch.zeros(x.shape[0], spec.top_k, x.shape[1], dtype=x.dtype)
        for expert in range(spec.num_experts):
            tok, j = torch.nonzero(routing.assigned == expert, as_tuple=True)
            if tok.numel():
                pair_outputs[tok, j] = swiglu(x_norm[tok], w13[expert], w2[expert])
        x = combine_pairs(x, routing.weights, pair_outputs)
        routings.append(routing)
    return x, routings
