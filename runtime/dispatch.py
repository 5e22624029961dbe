"""Dispatch and combine over the EP group: split counts first, then all_to_all_single with uneven splits.

One layer on one rank: the pairs that survived capacity pick their slot (placement.choose_slots),
are sorted by slot (which sorts them by destination rank), and the per-slot counts go round with an
all_to_all of W x (P/W) integers. With the counts on the host, the token rows go out in one
all_to_all_single with uneven splits, are regrouped by local slot into ragged per-expert segments
for the grouped GEMM, and the results come back by the reverse all_to_all_single. Dropped and padding
pairs never leave their rank and come back as zeros.

With `schedule="aurora"` (config a2a_schedule) every rank gathers the whole [W, W] send-count
matrix instead of its own row and column, plans the same rounds from it
(moewatch.planner.a2a_schedule: each rank sends to at most one rank and receives from at most one per
round) and moves the rows as point-to-point rounds (isend/irecv: gloo on the CPU, NCCL on a GPU) into
the very buffers the single collective would fill, so the outputs are bit for bit the same. The
combine runs the same rounds backwards.

Sizes: N tokens, k top-k, d hidden, M pairs sent by this rank, R rows received, W ranks, P slots,
S = P / W local slots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from moewatch.plan import A2A_SCHEDULES
from moewatch.planner.a2a_schedule import A2ASchedule, plan_exchange, transfer_bound_seconds

from .placement import ReplicaTable, choose_slots


@dataclass
class ExchangeLog:
    """Per layer and step of this rank: when its row exchanges began and ended (time.monotonic, one
    clock for every process on a machine, so ranks can be lined up). Kept only when asked for
    (emulated-link runs and benchmarks): it grows with every step."""

    spans: list = field(default_factory=list)  # (layer, phase 0 dispatch | 1 combine, start, end)


@dataclass
class Exchange:
    """How one rank moves rows over the EP group: the collective as is, or Aurora's rounds."""

    schedule: str = "none"
    # [W] each rank's link rate (bytes per second): the whole [W, W] matrix is gathered even when
    # unscheduled, and each exchange's bound goes to on_bound(layer, seconds of one direction)
    link_bytes_per_second: list | None = None
    row_bytes: int = 0
    # A round's fixed cost (its synchronisation) in rows' worth of link time: when whole-transfer
    # rounds are predicted faster than the bound-reaching split once it is counted, they run instead
    round_cost_rows: float = 0.0
    on_bound: Callable[[int, float], None] | None = None
    log: ExchangeLog | None = None
    layer: int = 0  # the layer being exchanged, for the log
    planned: int = 0  # dispatches that ran as planned rounds (a count for checks and reports)
    most_rounds: int = 0

    def __post_init__(self) -> None:
        if self.schedule not in A2A_SCHEDULES:
            raise ValueError(f"schedule: expected one of {', '.join(A2A_SCHEDULES)}, got {self.schedule!r}")

    @property
    def gathers(self) -> bool:
        return self.schedule == "aurora" or self.link_bytes_per_second is not None


@dataclass
class Dispatched:
    rows: torch.Tensor  # [R, d] received rows grouped by local slot (segment order)
    segment_counts: list[int]  # [S] rows per local slot, host ints (the ragged segments)
    pair_index: torch.Tensor  # [M] flat pair index (t * k + j) of each sent row, in send order
    send_splits: list[int]  # [W] rows sent to each rank
    recv_splits: list[int]  # [W] rows received from each rank
    arrival_index: torch.Tensor  # [R] arrival-order index of each segment-order row
    slot_counts: torch.Tensor  # [P] pairs this rank sent to each slot (device)
    recv_counts: torch.Tensor  # [W, S] rows received from each rank for each local slot (device)
    plan: A2ASchedule | None = None  # the rounds, when the exchange is scheduled

    @property
    def dest_counts(self) -> torch.Tensor:
        """[W] pairs this rank sent to each rank (its own included: the local pairs)."""
        return self.slot_counts.view(self.recv_counts.shape).sum(dim=1)

    @property
    def source_counts(self) -> torch.Tensor:
        """[W] pairs this rank received from each rank (its own included)."""
        return self.recv_counts.sum(dim=1)


def _all_to_all(output: torch.Tensor, inp: torch.Tensor, output_splits, input_splits, group) -> None:
    if group is None and not dist.is_initialized():
        output.copy_(inp)  # a world of one: everything is local
        return
    dist.all_to_all_single(output, inp, output_splits, input_splits, group=group)


def _peer(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _rounds(output: torch.Tensor, inp: torch.Tensor, output_splits, input_splits, plan: A2ASchedule,
            rank: int, group, backwards: bool) -> None:
    """The rows of one exchange as the plan's point-to-point rounds; the same buffers, filled the same
    way as all_to_all_single fills them. backwards: the combine (what rank i sent j in round r, j
    sends back to i in round r)."""
    in_start = np.concatenate([[0], np.cumsum(input_splits)[:-1]])
    out_start = np.concatenate([[0], np.cumsum(output_splits)[:-1]])
    dest, amount, offset = plan.dest, plan.amount, plan.offset
    source = plan.source()
    for r in range(plan.num_rounds):
        to, frm = int(dest[r, rank]), int(source[r, rank])
        if backwards:
            to, frm = frm, to
        ops = []
        if to >= 0:
            # Forward: my chunk of the (me, to) block; backwards: the chunk `to` sent me in this round.
            n, at = (int(amount[r, to]), int(offset[r, to])) if backwards else (int(amount[r, rank]), int(offset[r, rank]))
            start = int(in_start[to]) + at
            ops.append(dist.isend(inp[start:start + n], _peer(group, to), group=group))
        if frm >= 0:
            n, at = (int(amount[r, rank]), int(offset[r, rank])) if backwards else (int(amount[r, frm]), int(offset[r, frm]))
            start = int(out_start[frm]) + at
            ops.append(dist.irecv(output[start:start + n], _peer(group, frm), group=group))
        for op in ops:
            op.wait()
    # What stays on this rank never crosses a link.
    n = int(input_splits[rank])
    if n:
        output[int(out_start[rank]):int(out_start[rank]) + n].copy_(inp[int(in_start[rank]):int(in_start[rank]) + n])


def _exchange_rows(output: torch.Tensor, inp: torch.Tensor, output_splits, input_splits, group,
                   exchange: Exchange | None, plan: A2ASchedule | None, rank: int, phase: int) -> None:
    log = exchange.log if exchange is not None else None
    start = time.monotonic() if log is not None else 0.0
    if plan is None:
        _all_to_all(output, inp, output_splits, input_splits, group)
    else:
        _rounds(output, inp, output_splits, input_splits, plan, rank, group, backwards=phase == 1)
    if log is not None:
        if output.device.type == "cuda":
            torch.cuda.synchronize(output.device)
        log.spans.append((exchange.layer, phase, start, time.monotonic()))


def dispatch(x_norm: torch.Tensor, assigned: torch.Tensor, rank: int, world_size: int, table: ReplicaTable,
             num_slots: int, group=None, exchange: Exchange | None = None) -> Dispatched:
    """Send each surviving pair's token row to the rank holding its slot.

    x_norm [N, d] rows to send, assigned [N, k] logical expert per pair (-1: not computed).
    exchange: how the rows move (None: one all_to_all_single).
    """
    top_k = assigned.shape[1]
    slots_per_rank = num_slots // world_size
    flat = assigned.reshape(-1)
    pair_index = torch.nonzero(flat >= 0).squeeze(1)
    slots = choose_slots(flat[pair_index], rank, table)
    order = torch.argsort(slots, stable=True)
    pair_index, slots = pair_index[order], slots[order]

    slot_counts = torch.bincount(slots, minlength=num_slots)
    plan = None
    if exchange is not None and exchange.gathers and world_size > 1:
        # Every rank gets the whole matrix, so every rank plans the same rounds.
        everyone = [torch.empty_like(slot_counts) for _ in range(world_size)]
        dist.all_gather(everyone, slot_counts, group=group)
        counts = torch.stack(everyone).view(world_size, world_size, slots_per_rank)  # [src, dst rank, slot]
        recv_counts = counts[:, rank].contiguous()
        matrix = counts.sum(dim=2).cpu().numpy()
        if exchange.link_bytes_per_second is not None and exchange.on_bound is not None:
            exchange.on_bound(exchange.layer,
                              transfer_bound_seconds(matrix, exchange.row_bytes, exchange.link_bytes_per_second))
        if exchange.schedule == "aurora":
            plan = plan_exchange(matrix, exchange.round_cost_rows)
            exchange.planned += 1
            exchange.most_rounds = max(exchange.most_rounds, plan.num_rounds)
    else:
        recv_counts = torch.empty_like(slot_counts)
        _all_to_all(recv_counts, slot_counts, None, None, group)
    recv_counts = recv_counts.view(world_size, slots_per_rank)
    # One host synchronisation for all split sizes (all_to_all_single needs them on the host).
    send_matrix, recv_matrix = torch.stack([slot_counts.view(world_size, slots_per_rank), recv_counts]).tolist()
    send_splits = [sum(row) for row in send_matrix]
    recv_splits = [sum(row) for row in recv_matrix]
    segment_counts = [sum(col) for col in zip(*recv_matrix)]

    send_rows = x_norm[pair_index // top_k]
    recv_rows = x_norm.new_empty(sum(recv_splits), x_norm.shape[1])
    _exchange_rows(recv_rows, send_rows, recv_splits, send_splits, group, exchange, plan, rank, 0)

    # Arrival order is (source rank, local slot); the grouped GEMM wants (local slot, source rank).
    local_slot = torch.arange(slots_per_rank, device=x_norm.device).repeat(world_size)
    slot_of_row = torch.repeat_interleave(local_slot, recv_counts.reshape(-1))
    arrival_index = torch.argsort(slot_of_row, stable=True)
    return Dispatched(recv_rows[arrival_index], segment_counts, pair_index, send_splits, recv_splits,
                      arrival_index, slot_counts, recv_counts, plan)


def combine(expert_rows: torch.Tensor, sent: Dispatched, num_tokens: int, top_k: int, group=None,
            exchange: Exchange | None = None, rank: int = 0) -> torch.Tensor:
    """Return expert outputs to the ranks that sent the pairs: [N, k, d], zeros where not computed.

    expert_rows [R, d] outputs in segment order (as `sent.rows`). A scheduled dispatch (sent.plan)
    comes back by the same rounds backwards; rank is this rank (needed then).
    """
    arrival = torch.empty_like(expert_rows)
    arrival[sent.arrival_index] = expert_rows
    back = expert_rows.new_empty(sent.pair_index.numel(), expert_rows.shape[1])
    _exchange_rows(back, arrival, sent.send_splits, sent.recv_splits, group, exchange, sent.plan, rank, 1)
    pair_outputs = expert_rows.new_zeros(num_tokens * top_k, expert_rows.shape[1])
    pair_outputs[sent.pair_index] = back
    return pair_outputs.view(num_tokens, top_k, -1)
