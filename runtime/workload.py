"""Workloads: the batches each rank runs, and (for synthetic routing) which experts their tokens pick.

Synthetic routing bypasses the learned router so a run is reproducible and its skew controllable:
- Zipf: the expert at popularity rank i (a fixed random order per layer) is picked with weight
  1 / (i + 1) ** zipf (0 is uniform);
- hot experts: the first `hot_experts` of that order carry `hot_share` of all pairs together;
- drift (workload "drift"): every `drift_every` steps the order rotates by max(hot_experts, 1)
  places, so the hot set moves to other experts;
- affinity: with probability `affinity`, a token's j-th expert at layer l + 1 is the image of its
  j-th expert at layer l under a fixed random permutation (inter-layer affinity, as ExFlow observes);
- each token's k experts are distinct, drawn without replacement (Gumbel top-k), best first.
Trace replay reads expert ids [tokens, layers, top_k] from a .npy file; a token row holding a
negative id is padding. Every draw is a pure function of (seed, step, rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .config import ConfigError
from .model import mix_seed

_ROUTING, _PADDING, _ORDER, _AFFINITY = 11, 12, 13, 14


@dataclass
class Batch:
    valid: torch.Tensor  # [N] bool; False marks a padding token
    expert_ids: torch.Tensor | None  # [N, L, k] int64 expert ids, or None (the learned router decides)

    @property
    def num_tokens(self) -> int:
        return int(self.valid.sum())


def _generator(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(mix_seed(*parts))


def padding_mask(seed: int, step: int, rank: int, num_tokens: int, pad_fraction: float) -> torch.Tensor:
    """[N] bool: floor(pad_fraction * N) padding tokens at random places (at least one real token)."""
    valid = torch.ones(num_tokens, dtype=torch.bool)
    pads = min(int(pad_fraction * num_tokens), num_tokens - 1)
    if pads > 0:
        places = torch.randperm(num_tokens, generator=_generator(seed, _PADDING, step, rank))[:pads]
        valid[places] = False
    return valid


def popularity(num_experts: int, zipf: float, hot_experts: int, hot_share: float) -> np.ndarray:
    """[E] pick probability by popularity rank (rank 0 hottest)."""
    weights = 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** zipf
    if hot_experts > 0:
        hot, cold = weights[:hot_experts], weights[hot_experts:]
        weights = np.concatenate([hot / hot.sum() * hot_share, cold / cold.sum() * (1.0 - hot_share)])
    return weights / weights.sum()


class SyntheticRouting:
    def __init__(self, num_layers: int, num_experts: int, top_k: int, *, zipf: float = 1.0,
                 hot_experts: int = 0, hot_share: float = 0.5, drift_every: int = 0, affinity: float = 0.0,
                 seed: int = 0):
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.drift_every, self.affinity, self.seed = drift_every, affinity, seed
        self.shift = max(hot_experts, 1)
        g = _generator(seed, _ORDER)
        self.order = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(num_layers)])  # [L, E]
        self.log_pick = torch.from_numpy(np.log(popularity(num_experts, zipf, hot_experts, hot_share)))
        g = _generator(seed, _AFFINITY)
        self.follow = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(num_layers)])

    def expert_log_weights(self, layer: int, step: int) -> torch.Tensor:
        """[E] log pick probability of each expert at this layer and step."""
        period = step // self.drift_every if self.drift_every else 0
        ranked = torch.roll(self.order[layer], -period * self.shift)
        out = torch.empty(self.num_experts, dtype=torch.float64)
        out[ranked] = self.log_pick
        return out

    def hot_set(self, layer: int, step: int, count: int) -> list[int]:
        """The `count` most popular experts of a layer at a step (for tests and the demo)."""
        return torch.argsort(self.expert_log_weights(layer, step), descending=True, stable=True)[:count].tolist()

    def sample(self, step: int, rank: int, num_tokens: int) -> torch.Tensor:
        """[N, L, k] distinct expert ids per token and layer, best first."""
        g = _generator(self.seed, _ROUTING, step, rank)
        ids = torch.empty(num_tokens, self.num_layers, self.top_k, dtype=torch.long)
        for layer in range(self.num_layers):
            gumbel = -torch.log(-torch.log(torch.rand(num_tokens, self.num_experts, generator=g,
                                                      dtype=torch.float64).clamp_min(1e-300)))
            keys = self.expert_log_weights(layer, step) + gumbel
            if layer > 0 and self.affinity > 0:
                follows = torch.rand(num_tokens, self.top_k, generator=g) < self.affinity
                targets = self.follow[layer][ids[:, layer - 1]]  # [N, k]
                bonus = torch.zeros_like(keys).scatter_add_(1, targets, follows.double() * 1e6)
                keys = keys + bonus
            ids[:, layer] = torch.topk(keys, self.top_k, dim=1, sorted=True).indices
        return ids


class TraceRouting:
    """Replays expert ids from a trace [T, L, k]; rank r at step s reads rows (s * W + r) * N + i, wrapping."""

    def __init__(self, path: str, num_layers: int, num_experts: int, top_k: int, world_size: int):
        try:
            trace = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ConfigError("trace", f"{path}: cannot read a .npy array ({exc})") from None
        if trace.ndim != 3 or trace.shape[1:] != (num_layers, top_k) or trace.shape[0] < 1:
            raise ConfigError("trace", f"{path}: expected [tokens, {num_layers}, {top_k}], got {list(trace.shape)}")
        if trace.dtype.kind not in "iu":
            raise ConfigError("trace", f"{path}: expert ids must be integers, got {trace.dtype}")
        if np.any(trace >= num_experts):
            raise ConfigError("trace", f"{path}: expert ids must be below {num_experts}")
        real = np.all(trace >= 0, axis=(1, 2))
        distinct = np.all(np.diff(np.sort(trace, axis=2), axis=2) != 0, axis=(1, 2))
        if np.any(real & ~distinct):
            raise ConfigError("trace", f"{path}: a token's top_k experts must be distinct within a layer")
        self.trace = torch.from_numpy(trace.astype(np.int64))
        self.world_size = world_size

    def sample(self, step: int, rank: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([N, L, k] ids with padding rows set to 0, [N] valid)."""
        start = (step * self.world_size + rank) * num_tokens
        rows = self.trace[(start + torch.arange(num_tokens)) % self.trace.shape[0]]
        valid = (rows >= 0).all(dim=2).all(dim=1)
        return rows.clamp_min(0), valid


class Workload:
    """The batch of one rank at one step, for a RuntimeConfig."""

    def __init__(self, cfg, rank: int):
        self.cfg, self.rank = cfg, rank
        self.synthetic = None
        self.trace = None
        if cfg.workload == "trace":
            self.trace = TraceRouting(cfg.trace, cfg.layers, cfg.experts, cfg.top_k, cfg.ranks)
        elif cfg.router == "synthetic":
            self.synthetic = SyntheticRouting(
                cfg.layers, cfg.experts, cfg.top_k, zipf=cfg.zipf, hot_experts=cfg.hot_experts,
                hot_share=cfg.hot_share, drift_every=cfg.drift_every if cfg.workload == "drift" else 0,
                affinity=cfg.affinity, seed=cfg.seed)

    def batch(self, step: int) -> Batch:
        cfg = self.cfg
        valid = padding_mask(cfg.seed, step, self.rank, cfg.batch_tokens, cfg.pad_fraction)
        if self.trace is not None:
            ids, trace_valid = self.trace.sample(step, self.rank, cfg.batch_tokens)
            valid = valid & trace_valid
            return Batch(valid, ids)
        ids = self.synthetic.sample(step, self.rank, cfg.batch_tokens) if self.synthetic else None
        return Batch(valid, ids)


def hot_start_placement(cfg) -> np.ndarray:
    """[L, P] a placement with each layer's hot experts (at step 0) on rank `cfg.hot_on_rank`.

    Per layer, experts in popularity order (hot first) fill the ranks' first E/W-ish slots, starting
    at the hot rank; each rank's spare slots hold more replicas of its own experts, so spares add no
    load to another rank and the skew stays where it was put."""
    routing = SyntheticRouting(cfg.layers, cfg.experts, cfg.top_k, zipf=cfg.zipf, hot_experts=cfg.hot_experts,
                               hot_share=cfg.hot_share, seed=cfg.seed)
    W, E, P = cfg.ranks, cfg.experts, cfg.num_slots
    S = P // W
    ranks = [(cfg.hot_on_rank + i) % W for i in range(W)]
    out = np.zeros((cfg.layers, P), dtype=np.int64)
    for layer in range(cfg.layers):
        seq = routing.hot_set(layer, 0, E)  # every expert, hottest first
        chunks = np.array_split(np.array(seq, dtype=np.int64), W)
        for chunk, rank in zip(chunks, ranks):
            own = chunk if len(chunk) else np.array(seq[:1], dtype=np.int64)
            cold = own[cfg.hot_experts:] if rank == cfg.hot_on_rank and len(own) > cfg.hot_experts else own
            spare = np.resize(cold[::-1], S - len(chunk))  # the coldest of its own experts first
            out[layer, rank * S:(rank + 1) * S] = np.concatenate([chunk, spare])
    return out
