"""One rank of the expert-parallel model: its slots' weights, the placement in force, the forward step.

Per layer: RMS norm -> router (or the workload's expert ids) -> capacity -> dispatch all_to_all ->
grouped expert GEMM over the local slots -> combine all_to_all -> weighted sum + residual. The probe,
when attached, gets marks and counts; the engine never waits on it.

Each layer's placement, replica table and weights live in one `LayerState`; a new placement swaps
the whole object, so a layer switches atomically.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .dispatch import Exchange, ExchangeLog, combine, dispatch
from .kernels import grouped_swiglu
from .model import ModelSpec, combine_pairs, init_experts, init_router, rms_norm, route_layer
from .placement import ReplicaTable, replica_table
from .probe import Mark, Probe
from .slowdown import run_slowed, start_factor

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LayerState:
    pmap_row: np.ndarray  # [P] logical expert of each slot
    table: ReplicaTable
    w13: torch.Tensor  # [S, d, 2f] this rank's slots
    w2: torch.Tensor  # [S, f, d]


@dataclass
class PairCounts:
    """Every pair this rank routed, by fate (padding excluded); routed = returned + dropped + lost."""

    routed: int = 0
    returned: int = 0  # computed by some slot and brought back by the combine
    dropped: int = 0
    rerouted: int = 0

    @property
    def lost(self) -> int:
        return self.routed - self.returned - self.dropped


class EPEngine:
    def __init__(self, cfg, rank: int, world_size: int, group=None, device: torch.device | str = "cpu",
                 probe: Probe | None = None):
        self.cfg = cfg
        self.spec = ModelSpec.from_config(cfg)
        self.rank, self.world_size, self.group = rank, world_size, group
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[cfg.dtype]
        self.num_slots = cfg.num_slots
        self.slots_per_rank = cfg.num_slots // world_size
        self.node_size = cfg.node_size
        self.probe = probe
        self.expert_compute = grouped_swiglu(cfg.kernel)
        # Emulated slow device (runtime/slowdown.py): expert compute takes this many times as long.
        # The step loop updates it at step boundaries; the outputs never change with it.
        self.slow_factor = start_factor(rank, cfg.slow_rank, cfg.slow_factor)
        self.routers = [init_router(self.spec, layer).to(self.device, self.dtype) for layer in range(cfg.layers)]
        self.capacity = np.full(cfg.layers, float(cfg.capacity_factor))
        self.epoch = 0
        pmap = cfg.initial_placement()
        self.layers = [self.build_layer(layer, pmap[layer]) for layer in range(cfg.layers)]
        self.pairs = PairCounts()
        # How rows cross the group (cfg.a2a_schedule; a Plan may switch it at a step boundary). With
        # known link rates the whole count matrix is gathered so each layer's bound is known.
        row_bytes = cfg.hidden * torch.empty((), dtype=self.dtype).element_size()
        # A round's fixed cost in rows needs a link rate; without one the rounds always reach the bound.
        round_rows = (cfg.a2a_round_seconds * min(cfg.link_bytes_per_second) / row_bytes
                      if cfg.link_bytes_per_second is not None else 0.0)
        self.exchange = Exchange(cfg.a2a_schedule, link_bytes_per_second=cfg.link_bytes_per_second,
                                 row_bytes=row_bytes, round_cost_rows=round_rows, on_bound=self._on_bound,
                                 log=ExchangeLog() if cfg.a2a_log else None)
        self.bound_log: list[tuple[int, float]] = []  # (layer, seconds one way), with the exchange log
        # When a list: every layer's (layer, LayerRouting, CapacityAssignment, slot_counts) is appended
        # (self-checks compare the probe with counts derived from these).
        self.routing_log: list | None = None
        self._dropped = torch.zeros((), dtype=torch.long, device=self.device)
        self._rerouted = torch.zeros((), dtype=torch.long, device=self.device)

    def _on_bound(self, layer: int, seconds: float) -> None:
        """One exchange's bound (one direction; the combine moves the same rows back)."""
        if self.exchange.log is not None:
            self.bound_log.append((layer, seconds))
        if self.probe is not None:
            self.probe.record_a2a_bound(layer, 2.0 * seconds)

    # --- placement ---------------------------------------------------------------------------------
    @property
    def local_slots(self) -> range:
        return range(self.rank * self.slots_per_rank, (self.rank + 1) * self.slots_per_rank)

    @property
    def placement(self) -> np.ndarray:
        """[L, P] the map in force."""
        return np.stack([state.pmap_row for state in self.layers])

    def build_layer(self, layer: int, pmap_row: np.ndarray, w13: torch.Tensor | None = None,
                    w2: torch.Tensor | None = None) -> LayerState:
        """A layer's state for a placement row; weights built from the spec unless given."""
        pmap_row = np.asarray(pmap_row, dtype=np.int64).copy()
        if w13 is None:
            w13, w2 = init_experts(self.spec, layer, pmap_row[self.local_slots.start:self.local_slots.stop],
                                   self.device, self.dtype)
        table = replica_table(pmap_row, self.world_size, self.node_size, self.spec.num_experts, self.device)
        return LayerState(pmap_row, table, w13, w2)

    def install(self, states: dict[int, LayerState], epoch: int, capacity: np.ndarray) -> None:
        """Switch to new layer states (each layer a single reference swap) under a new epoch."""
        for layer, state in states.items():
            self.layers[layer] = state
        self.capacity = np.asarray(capacity, dtype=np.float64).copy()
        self.epoch = int(epoch)

    # --- forward -----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, valid: torch.Tensor, expert_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One step on this rank's batch: x [N, d], valid [N] bool, expert_ids [N, L, k] or None."""
        probe = self.probe
        x = x.to(self.device, self.dtype)
        valid = valid.to(self.device)
        if expert_ids is not None:
            expert_ids = expert_ids.to(self.device)
        num_tokens, top_k = x.shape[0], self.spec.top_k
        real_tokens = int(valid.sum())
        overflow = self.cfg.overflow
        for layer, state in enumerate(self.layers):
            capacity = float(self.capacity[layer])
            if probe is not None:
                probe.mark(layer, Mark.LAYER_START)
            x_norm = rms_norm(x)
            forced = None if expert_ids is None else expert_ids[:, layer]
            routing, fate = route_layer(x_norm, valid, self.routers[layer], self.spec, forced, capacity, overflow,
                                        real_tokens)
            if probe is not None:
                probe.mark(layer, Mark.DISPATCH_START)
            self.exchange.layer = layer
            sent = dispatch(x_norm, routing.assigned, self.rank, self.world_size, state.table, self.num_slots,
                            self.group, self.exchange)
            if probe is not None:
                probe.mark(layer, Mark.DISPATCH_END)
            if self.slow_factor > 1.0:
                expert_out = run_slowed(self.expert_compute, self.slow_factor, sent.rows, sent.segment_counts,
                                        state.w13, state.w2)
            else:
                expert_out = self.expert_compute(sent.rows, sent.segment_counts, state.w13, state.w2)
            if probe is not None:
                probe.mark(layer, Mark.COMPUTE_END)
            pair_outputs = combine(expert_out, sent, num_tokens, top_k, self.group, self.exchange, self.rank)
            x = combine_pairs(x, routing.weights, pair_outputs)
            if probe is not None:
                probe.mark(layer, Mark.LAYER_END)
                limited = capacity > 0
                probe.record_layer(layer, fate.routed, sent.slot_counts,
                                   fate.dropped if limited else None, fate.rerouted if limited else None)
            if self.routing_log is not None:
                self.routing_log.append((layer, routing, fate, sent.slot_counts))
            self.pairs.routed += real_tokens * top_k
            self.pairs.returned += int(sent.pair_index.numel())
            if capacity > 0:
                self._dropped += fate.dropped.sum()
                self._rerouted += fate.rerouted.sum()
        return x

    def pair_counts(self) -> PairCounts:
        """The accounting so far (reads the device counters: call outside the step loop's hot path)."""
        self.pairs.dropped = int(self._dropped)
        self.pairs.rerouted = int(self._rerouted)
        return PairCounts(self.pairs.routed, self.pairs.returned, self.pairs.dropped, self.pairs.rerouted)
