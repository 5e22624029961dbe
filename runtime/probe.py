"""The probe: what an EP runtime did, counted on the device, reduced into one Window per window.

Any torch MoE runtime can embed it (docs/probe.md). Per step and layer the runtime hands it tensors
it already has (pairs per logical expert before capacity, pairs per slot after, dropped and rerouted
pairs) and marks phase boundaries; the probe adds the counts into an accumulator on the device and
keeps the marks: CUDA events on a GPU, resolved only when the window is flushed, perf_counter on the
CPU. Nothing in a step synchronises with the host or talks to other ranks.

Every `window_steps` steps (or about `window_seconds`) each rank calls the flush at the same step;
one all_reduce over the runtime's own process group sums the ranks' contributions, and rank 0 builds
the Window (docs/telemetry.md, validated) and hands it to its sinks (a non-blocking sender, a file...).
Per-rank quantities travel as one column per rank, so the sum carries them exactly. Traffic comes
from each rank's pairs per slot: the slots of rank j receive what rank i sent to j, so local, sent
and received pairs all follow from the [W, W] matrix and agree by construction.

How windows end: after `window_steps` steps, or, with `window_seconds`, after the number of steps
the previous window's pace says fits in that time (every rank computes the same number from the
reduced timings, so no rank needs to ask another when to flush).

Sizes: L layers, E experts, P slots, W ranks, S steps in the window.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from moewatch.telemetry import Window, WindowError, a2a_over_bound

RUNTIME_NAME = "moewatch-runtime"


class Mark(enum.IntEnum):
    """Phase boundaries within one layer. dispatch = DISPATCH_END - DISPATCH_START, compute =
    COMPUTE_END - DISPATCH_END, combine = COMBINE_END - COMPUTE_END (LAYER_END when COMBINE_END is
    not marked), layer = LAYER_END - LAYER_START."""

    LAYER_START = 0
    DISPATCH_START = 1
    DISPATCH_END = 2
    COMPUTE_END = 3
    COMBINE_END = 4
    LAYER_END = 5


_NUM_MARKS = len(Mark)


@dataclass
class ProbeConfig:
    num_layers: int
    num_experts: int
    num_slots: int
    top_k: int
    hidden_bytes: int  # bytes one pair moves each way: hidden size x element size
    ranks_per_node: int | None = None  # None: the whole group is one node
    model: str = "model"
    ep_group: str = "ep0"
    runtime: str = RUNTIME_NAME
    window_steps: int | None = 50
    window_seconds: float | None = None
    first_window_steps: int = 8  # a time-only window's length before any pace is known
    traffic_max_ranks: int = 16  # carry the [W, W] matrix in the Window up to this many ranks


class _HostTimer:
    """perf_counter marks, kept raw per step; durations are worked out at flush (numpy, once)."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self._marks = np.full((num_layers, _NUM_MARKS), np.nan)
        self._step_start = 0.0
        self.reset()

    def reset(self) -> None:
        self._steps: list[np.ndarray] = []  # [L, 6] marks of each step
        self.step_seconds: list[float] = []

    def begin_step(self) -> None:
        self._marks = np.full((self.num_layers, _NUM_MARKS), np.nan)
        self._steps.append(self._marks)
        self._step_start = time.perf_counter()

    def mark(self, layer: int, mark: int) -> None:
        self._marks[layer, mark] = time.perf_counter()

    def end_step(self) -> None:
        self.step_seconds.append(time.perf_counter() - self._step_start)

    def resolve(self) -> tuple[np.ndarray, list[float]]:
        if not self._steps:
            return np.zeros((4, self.num_layers)), []
        return _phase_seconds(np.stack(self._steps)), self.step_seconds


def _phase_seconds(marks: np.ndarray) -> np.ndarray:
    """[4, L] dispatch, compute, combine and layer time summed over steps, from marks [S, L, 6]
    (NaN = not marked; an unmarked span counts zero)."""
    combine_end = np.where(np.isnan(marks[..., Mark.COMBINE_END]), marks[..., Mark.LAYER_END],
                           marks[..., Mark.COMBINE_END])
    spans = np.stack([
        marks[..., Mark.DISPATCH_END] - marks[..., Mark.DISPATCH_START],
        marks[..., Mark.COMPUTE_END] - marks[..., Mark.DISPATCH_END],
        combine_end - marks[..., Mark.COMPUTE_END],
        marks[..., Mark.LAYER_END] - marks[..., Mark.LAYER_START],
    ])  # [4, S, L]
    return np.clip(np.nan_to_num(spans, nan=0.0), 0.0, None).sum(axis=1)


class _EventTimer:
    """CUDA events recorded in the stream; elapsed times are read only in `resolve` (at flush)."""

    def __init__(self, num_layers: int, device: torch.device):
        self.num_layers = num_layers
        self.device = device
        self._pool: list[torch.cuda.Event] = []
        self._used = 0
        self.reset()

    def reset(self) -> None:
        self._used = 0
        self._steps: list[tuple[int, int, list[list[int]]]] = []  # (start event, end event, [L][6] events)
        self._current: list[list[int]] = []
        self._start = -1

    def _record(self) -> int:
        if self._used == len(self._pool):
            self._pool.append(torch.cuda.Event(enable_timing=True))
        index = self._used
        self._used += 1
        self._pool[index].record()
        return index

    def begin_step(self) -> None:
        self._current = [[-1] * _NUM_MARKS for _ in range(self.num_layers)]
        self._start = self._record()

    def mark(self, layer: int, mark: int) -> None:
        self._current[layer][mark] = self._record()

    def end_step(self) -> None:
        self._steps.append((self._start, self._record(), self._current))

    def resolve(self) -> tuple[np.ndarray, list[float]]:
        sums = np.zeros((4, self.num_layers))
        step_seconds: list[float] = []
        if not self._steps:
            return sums, step_seconds
        self._pool[self._steps[-1][1]].synchronize()
        for start, end, layers in self._steps:
            step_seconds.append(self._pool[start].elapsed_time(self._pool[end]) / 1e3)
            marks = np.full((self.num_layers, _NUM_MARKS), np.nan)
            for layer, events in enumerate(layers):
                base = events[Mark.LAYER_START]
                if base < 0:
                    continue
                marks[layer, Mark.LAYER_START] = 0.0
                for mark in range(1, _NUM_MARKS):
                    if events[mark] >= 0:
                        marks[layer, mark] = self._pool[base].elapsed_time(self._pool[events[mark]]) / 1e3
            sums += _phase_seconds(marks[None])
        return sums, step_seconds


class Probe:
    """Per-rank recorder of one EP group's routing, traffic and timings; collective flushes.

    rank / world_size / group: the runtime's own EP process group (group=None and world_size=1
    work without torch.distributed). sinks: callables taking a Window, called on rank 0 only.
    """

    def __init__(self, config: ProbeConfig, *, rank: int = 0, world_size: int = 1, group=None,
                 device: torch.device | str = "cpu", sinks: Sequence[Callable[[Window], object]] = ()):
        self.cfg = config
        self.rank, self.world_size, self.group = rank, world_size, group
        self.device = torch.device(device)
        if config.num_slots % world_size:
            raise ValueError(f"num_slots: {config.num_slots} slots do not divide over {world_size} ranks")
        if config.window_steps is None and config.window_seconds is None:
            raise ValueError("window_steps: give window_steps, window_seconds or both")
        self.sinks = list(sinks)
        L, E, P = config.num_layers, config.num_experts, config.num_slots
        self._width = E + P + 2 * E  # routed | slots | dropped | rerouted
        self._counts = torch.zeros(L, self._width, dtype=torch.int64, device=self.device)
        # Recorded tensors wait here and are summed a batch of steps at a time, a few kernel
        # launches per batch instead of two per layer and step (launches are what cost on a GPU).
        self._pending: list[tuple] = []  # (layer, expert_counts, slot_counts, dropped, rerouted)
        self._pending_steps = 0
        self._index_cache: dict[tuple[int, ...], torch.Tensor] = {}
        self._timer = _EventTimer(L, self.device) if self.device.type == "cuda" else _HostTimer(L)
        self.mark = self._timer.mark  # the hottest call: no extra Python frame in between
        self._step_tokens: list[int | torch.Tensor] = []
        self._window_wall_start = 0.0
        self._window_unix_start = 0.0
        self._target_steps = config.window_steps or config.first_window_steps
        self.epoch = 0
        self.physical_to_logical_map = np.tile(np.arange(P, dtype=np.int64) % E, (L, 1))
        self.capacity_factor = np.zeros(L)
        # What happened, for the runtime's report.
        self.windows_built = 0
        self.windows_invalid = 0
        self.last_error = ""
        self._bound = np.zeros(L)
        self._bound_records = 0

    # --- placement in force ------------------------------------------------------------------------
    def set_placement(self, epoch: int, physical_to_logical_map, capacity_factor) -> None:
        """Declare the placement from now on. A window never spans two placements: when steps are
        pending this flushes first, so call it on every rank at the same step boundary."""
        pmap = np.asarray(physical_to_logical_map, dtype=np.int64)
        cap = np.asarray(capacity_factor, dtype=np.float64)
        if pmap.shape != (self.cfg.num_layers, self.cfg.num_slots):
            raise ValueError(f"physical_to_logical_map: shape {list(pmap.shape)} does not match "
                             f"[{self.cfg.num_layers}, {self.cfg.num_slots}]")
        if cap.shape != (self.cfg.num_layers,):
            raise ValueError(f"capacity_factor: expected {self.cfg.num_layers} values")
        if self.steps_pending:
            self.flush()
        self.epoch = int(epoch)
        self.physical_to_logical_map = pmap.copy()
        self.capacity_factor = cap.copy()

    # --- per step ----------------------------------------------------------------------------------
    @property
    def steps_pending(self) -> int:
        return len(self._step_tokens)

    def begin_step(self, num_tokens: int | torch.Tensor) -> None:
        """Start a forward step over `num_tokens` real tokens on this rank (padding excluded)."""
        if not self._step_tokens:
            self._window_wall_start = time.perf_counter()
            self._window_unix_start = time.time()
        self._step_tokens.append(num_tokens)
        self._timer.begin_step()

    def mark(self, layer: int, mark: Mark) -> None:
        """Timestamp a phase boundary of a layer (replaced per instance by the timer's own method)."""
        self._timer.mark(layer, mark)

    def record_layer(self, layer: int, expert_counts: torch.Tensor, slot_counts: torch.Tensor,
                     dropped: torch.Tensor | None = None, rerouted: torch.Tensor | None = None) -> None:
        """Add one layer's counts for this rank's pairs (device tensors, int64):
        expert_counts [E] pairs routed to each logical expert before capacity; slot_counts [P] pairs
        this rank sent to each slot (its own slots included) after capacity; dropped / rerouted [E]
        at the expert the pairs were routed to (None: no capacity limit in force).

        The probe keeps references to these tensors for up to FOLD_STEPS steps before summing them:
        do not modify them in place afterwards (pass fresh tensors, or clones)."""
        self._pending.append((layer, expert_counts, slot_counts, dropped, rerouted))

    FOLD_STEPS = 16

    def record_a2a_bound(self, layer: int, seconds: float) -> None:
        """Add one step's all-to-all bound of a layer (dispatch + combine, seconds at the links' rates:
        the same on every rank, which all know the whole matrix). A window gets `a2a_bound_seconds`
        and `a2a_over_bound` only when every step of it recorded every layer's bound."""
        self._bound[layer] += seconds
        self._bound_records += 1

    def _layer_index(self, layers: tuple[int, ...]) -> torch.Tensor:
        # Steady state records the same layer sequence every batch: build its index tensor once.
        index = self._index_cache.get(layers)
        if index is None:
            if len(self._index_cache) > 64:
                self._index_cache.clear()
            index = torch.tensor(layers, dtype=torch.long, device=self.device)
            self._index_cache[layers] = index
        return index

    def _fold(self) -> None:
        """Sum the pending records into the window's accumulator, on the device, with index_add_."""
        records = self._pending
        self._pending = []
        self._pending_steps = 0
        if not records:
            return
        split = self.cfg.num_experts + self.cfg.num_slots
        rows = torch.cat([torch.stack([r[1] for r in records]), torch.stack([r[2] for r in records])], dim=1)
        self._counts[:, :split].index_add_(0, self._layer_index(tuple(r[0] for r in records)), rows.long())
        limited = [r for r in records if r[3] is not None]
        if limited:
            overflow = torch.cat([torch.stack([r[3] for r in limited]), torch.stack([r[4] for r in limited])], dim=1)
            self._counts[:, split:].index_add_(0, self._layer_index(tuple(r[0] for r in limited)), overflow.long())

    def count_topk(self, topk_ids: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Helper for runtimes without their own counts: [E] bincount of topk_ids [N, k] over real tokens."""
        ids = topk_ids if valid is None else topk_ids[valid.bool()]
        return torch.bincount(ids.reshape(-1).long(), minlength=self.cfg.num_experts)

    def end_step(self) -> Window | None:
        """Close the step; flushes (collectively) when the window is due. Returns the Window on rank 0."""
        self._timer.end_step()
        self._pending_steps += 1
        if self._pending_steps >= self.FOLD_STEPS:
            self._fold()
        if self.steps_pending >= self._target_steps:
            return self.flush()
        return None

    # --- flush -------------------------------------------------------------------------------------
    def flush(self) -> Window | None:
        """Reduce the window over the group and hand it to the sinks (rank 0). Collective: every rank
        calls it at the same step. Returns the Window on rank 0, None elsewhere or when empty."""
        steps = self.steps_pending
        if steps == 0:
            return None
        cfg = self.cfg
        L, E, P, W = cfg.num_layers, cfg.num_experts, cfg.num_slots, self.world_size
        self._fold()
        times, step_seconds = self._timer.resolve()  # the only host synchronisation: here, at flush
        wall = time.perf_counter() - self._window_wall_start
        end_unix = time.time()

        counts = self._counts.to(torch.float64)
        traffic = torch.zeros(L, W, W, dtype=torch.float64, device=self.device)
        traffic[:, self.rank] = counts[:, E:E + P].reshape(L, W, P // W).sum(dim=2)
        per_rank = torch.zeros(4, L, W, dtype=torch.float64)
        per_rank[:, :, self.rank] = torch.from_numpy(times)
        per_step = torch.zeros(2, W, steps, dtype=torch.float64)
        per_step[0, self.rank] = torch.tensor(step_seconds, dtype=torch.float64)
        per_step[1, self.rank] = torch.stack([torch.as_tensor(t, dtype=torch.float64, device=self.device)
                                              for t in self._step_tokens]).cpu()
        walls = torch.zeros(W, dtype=torch.float64)
        walls[self.rank] = wall
        flat = torch.cat([counts.reshape(-1), traffic.reshape(-1),
                          torch.cat([per_rank.reshape(-1), per_step.reshape(-1), walls]).to(self.device)])
        if self.group is not None or dist.is_initialized():
            dist.all_reduce(flat, group=self.group)
        flat = flat.cpu().numpy()

        sizes = [L * self._width, L * W * W, 4 * L * W, 2 * W * steps, W]
        parts = np.split(flat, np.cumsum(sizes)[:-1])
        counts_np = np.rint(parts[0].reshape(L, self._width)).astype(np.int64)
        traffic_np = np.rint(parts[1].reshape(L, W, W)).astype(np.int64)
        per_step_np = parts[3].reshape(2, W, steps)
        # Every rank derives the next window's length from the same reduced numbers.
        self._next_target(steps, float(parts[4].max()))
        bound = self._bound.copy() if self._bound_records == steps * L else None
        self._reset()
        if self.rank != 0:
            return None

        local = np.diagonal(traffic_np, axis1=1, axis2=2).copy()
        timing = parts[2].reshape(4, L, W)
        fields = dict(
            runtime=cfg.runtime, model=cfg.model, ep_group=cfg.ep_group, world_size=W,
            ranks_per_node=cfg.ranks_per_node or W, num_layers=L, num_experts=E, num_slots=P, top_k=cfg.top_k,
            epoch=self.epoch, steps=steps, start_time=self._window_unix_start,
            end_time=max(end_unix, self._window_unix_start), hidden_bytes=cfg.hidden_bytes,
            physical_to_logical_map=self.physical_to_logical_map,
            expert_tokens=counts_np[:, :E], slot_tokens=counts_np[:, E:E + P],
            dropped_tokens=counts_np[:, E + P:2 * E + P], rerouted_tokens=counts_np[:, 2 * E + P:],
            capacity_factor=self.capacity_factor,
            local_tokens=local,
            sent_tokens=traffic_np.sum(axis=2) - local,
            received_tokens=traffic_np.sum(axis=1) - local,
            traffic=traffic_np if W <= cfg.traffic_max_ranks else None,
            dispatch_seconds=timing[0], compute_seconds=timing[1], combine_seconds=timing[2],
            layer_seconds=timing[3],
            step_seconds=per_step_np[0].max(axis=0),  # a collective step ends when its slowest rank does
            step_tokens=np.rint(per_step_np[1].sum(axis=0)).astype(np.int64),
        )
        if bound is not None:
            fields.update(a2a_bound_seconds=bound,
                          a2a_over_bound=a2a_over_bound(timing[0] + timing[2], bound))
        try:
            window = Window(**fields)
        except WindowError as exc:  # a bug in the embedding runtime's counts: report, never crash the step
            self.windows_invalid += 1
            self.last_error = str(exc)
            return None
        self.windows_built += 1
        for sink in self.sinks:
            sink(window)
        return window

    def _next_target(self, steps: int, wall_seconds: float) -> None:
        cap = self.cfg.window_steps
        if self.cfg.window_seconds is None:
            self._target_steps = cap
            return
        pace = steps / wall_seconds if wall_seconds > 0 else float(steps)
        target = max(1, int(math.floor(round(self.cfg.window_seconds * pace, 6))))
        self._target_steps = min(target, cap) if cap else target

    def _reset(self) -> None:
        self._bound = np.zeros(self.cfg.num_layers)
        self._bound_records = 0
        self._counts.zero_()
        self._pending = []
        self._timer.reset()
        self._step_tokens = []
