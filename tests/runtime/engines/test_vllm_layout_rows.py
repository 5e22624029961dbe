"""The pure parts of reading vLLM's layouts (runtime/engines/vllm_layout.py): which rows of a router's
input are this process's, which shard it writes, how many of its group's ranks share a node, and a
micro-batch's pair weights; and the counter counting a slice of rows with the weights given. vLLM's
own functions shape these inputs in test_vllm_layouts.py; here every layout is checked row by row."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moewatch.runtime.engines.common import PairCounter, PairWeights
from moewatch.runtime.engines.vllm_layout import local_rows, micro_batch_weights, ranks_per_node, shard_layout


def test_rows_gathered_across_dp_are_this_ranks_span_and_its_own_batch_is_all_of_it():
    # DP 3 with 4, 2 and 5 rows: gathered (11 rows), rank 2's are rows 6..10 of them.
    assert local_rows(11, [4, 2, 5], 2, None, 0, 1, False) == (6, 5, 0)
    assert local_rows(11, [4, 2, 5], 0, None, 0, 1, False) == (0, 4, 0)
    assert local_rows(2, [4, 2, 5], 1, None, 0, 1, False) == (0, 2, 0)  # its own rows only
    assert local_rows(3, [4, 2, 5], 1, None, 0, 1, False) is None  # neither: not guessed


def test_sequence_parallel_rows_are_this_tp_ranks_chunk_at_its_offset():
    # DP 2 x TP 2: rank 0 has 7 rows (chunks of 4: rows 0..3 and 4..7, the last padding), rank 1 has 4.
    chunks = [4, 4, 2, 2]  # vLLM's _compute_sp_num_tokens, DP-then-TP
    assert local_rows(4, [7, 4], 0, chunks, 1, 2, True) == (0, 4, 4)  # its chunk alone
    assert local_rows(12, [7, 4], 0, chunks, 1, 2, True) == (4, 4, 4)  # gathered: after rank (0, 0)'s
    assert local_rows(12, [7, 4], 1, chunks, 1, 2, True) == (10, 2, 2)
    assert local_rows(2, [7, 4], 1, chunks, 0, 2, True) == (0, 2, 0)
    assert local_rows(7, [7, 4], 0, chunks, 0, 2, True) is None  # unchunked rows under SP: not guessed


def test_shard_layout_from_vllms_parallel_config():
    assert shard_layout(dp_size=1, dp_rank=0, tp_size=4, tp_rank=0, sp_size=1, use_ep=True, ep_rank=0) is None
    dp = shard_layout(dp_size=4, dp_rank=3, tp_size=1, tp_rank=0, sp_size=1, use_ep=True, ep_rank=3)
    assert (dp.index, dp.count, dp.rank) == (3, 4, 3)
    # TP without sequence parallelism: TP rank 0 reports its DP rank's tokens; EP rank = dp x tp.
    tp = shard_layout(dp_size=2, dp_rank=1, tp_size=2, tp_rank=0, sp_size=1, use_ep=True, ep_rank=2)
    assert (tp.index, tp.count, tp.rank) == (1, 2, 2)
    sp = shard_layout(dp_size=2, dp_rank=1, tp_size=2, tp_rank=1, sp_size=2, use_ep=True, ep_rank=3)
    assert (sp.index, sp.count, sp.rank) == (3, 4, 3)
    no_ep = shard_layout(dp_size=2, dp_rank=1, tp_size=1, tp_rank=0, sp_size=1, use_ep=False, ep_rank=0)
    assert (no_ep.index, no_ep.count, no_ep.rank) == (1, 2, 0)  # one rank's group: its rank is 0
    assert sp.shard(7) == {"index": 3, "count": 4, "rank": 3, "sequence": 7}


def parallel(tp=1, dp=1, dp_local=1, nodes_within_dp=1, pcp=1):
    return SimpleNamespace(tensor_parallel_size=tp, data_parallel_size=dp, data_parallel_size_local=dp_local,
                           nnodes_within_dp=nodes_within_dp, prefill_context_parallel_size=pcp)


def test_ranks_per_node_from_vllms_config():
    assert ranks_per_node(parallel(dp=16, dp_local=8), 16) == 8  # DP 16 over two nodes of 8 GPUs
    assert ranks_per_node(parallel(tp=2, dp=8, dp_local=4), 16) == 8
    assert ranks_per_node(parallel(tp=8, dp=2, dp_local=1, nodes_within_dp=2), 16) == 4  # a replica on two nodes
    assert ranks_per_node(parallel(dp=4, dp_local=4), 4) == 4  # one node
    assert ranks_per_node(parallel(dp=6, dp_local=4), 6) == 6  # does not divide the group: the whole group
    assert ranks_per_node(SimpleNamespace(), 8) == 8  # a config without these fields


def test_micro_batch_weights_are_its_real_rows_and_nothing_outside_a_step():
    is_padding = torch.tensor([False, False, True, True])
    armed = torch.ones(1, dtype=torch.int64)
    assert micro_batch_weights(is_padding, 0, 4, 2, armed).tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert micro_batch_weights(is_padding, 2, 3, 1, armed).tolist() == [0, 0, 0]  # past its end: 0
    assert micro_batch_weights(is_padding, 0, 2, 1, torch.zeros(1, dtype=torch.int64)).tolist() == [0, 0]


@pytest.mark.parametrize("slots", [False, True])
def test_counter_counts_a_slice_of_rows_with_the_weights_given(slots):
    weights = PairWeights(max_tokens=16, top_k=2, device="cpu")
    weights.arm(3)
    counter = PairCounter(4, weights, num_slots=4 if slots else 0)
    ids = torch.tensor([[0, 1], [2, 3], [1, 1]])
    # Three real rows armed; these ids are rows 2..4 of the rank's batch: only the first is real.
    add = counter.add_slots if slots else counter.add
    add(ids, pair_weights=weights.tensor[2 * 2:5 * 2])
    got = counter.slot_counts if slots else counter.counts
    assert got.tolist() == [1, 1, 0, 0]
