"""Dispatch and combine over the EP group: split counts first, then all_to_all_single with uneven splits.

One layer on one rank: the pairs that survived capacity pick their slot (placement.choose_slots),
are sorted by slot (which sorts them by destination rank), and the per-slot counts go round with an
all_to_all of W x (P/W) integers. With the counts on the host, the token rows go out in one
all_to_all_single with uneven splits, are regrouped by local slot into ragged per-expert segments
for the grouped GEMM, and the results come back by the reverse all_to_all_single. Dropped and padding
pairs never leave their rank and come back as zeros.

Sizes: N tokens, k top-k, d hidden, M pairs sent by this rank, R rows received, W ranks, P slots,
S = P / W local slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .placement import ReplicaTable, choose_slots


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


def dispatch(x_norm: torch.Tensor, assigned: torch.Tensor, rank: int, world_size: int, table: ReplicaTable,
             num_slots: int, group=None) -> Dispatched:
    """Send each surviving pair's token row to the rank holding its slot.

    x_norm [N, d] rows to send, assigned [N, k] logical expert per pair (-1: not computed).
    """
    top_k = assigned.shape[1]
    slots_per_rank = num_slots // world_size
    flat = assigned.reshape(-1)
    pair_index = torch.nonzero(flat >= 0).squeeze(1)
    slots = choose_slots(flat[pair_index], rank, table)
    order = torch.argsort(slots, stable=True)
    pair_index, slots = pair_index[order], slots[order]

    slot_counts = torch.bincount(slots, minlength=num_slots)
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
    _all_to_all(recv_rows, send_rows, recv_splits, send_splits, group)

    # Arrival order is (source rank, local slot); the grouped GEMM wants (local slot, source rank).
    local_slot = torch.arange(slots_per_rank, device=x_norm.device).repeat(world_size)
    slot_of_row = torch.repeat_interleave(local_slot, recv_counts.reshape(-1))
    arrival_index = torch.argsort(slot_of_row, stable=True)
    return Dispatched(recv_rows[arrival_index], segment_counts, pair_index, send_splits, recv_splits,
                      arrival_index, slot_counts, recv_counts)


def combine(expert_rows: torch.Tensor, sent: Dispatched, num_tokens: int, top_k: int, group=None) -> torch.Tensor:
    """Return expert outputs to the ranks that sent the pairs: [N, k, d], zeros where not computed.

    expert_rows [R, d] outputs in segment order (as `sent.rows`).
    """
    arrival = torch.empty_like(expert_rows)
    arrival[sent.arrival_index] = expert_rows
    back = expert_rows.new_empty(sent.pair_index.numel(), expert_rows.shape[1])
    _all_to_all(back, arrival, sent.send_splits, sent.recv_splits, group)
    pair_outputs = expert_rows.new_zeros(num_tokens * top_k, expert_rows.shape[1])
    pair_outputs[sent.pair_index] = back
    return pair_outputs.view(num_tokens, top_k, -1)
