"""Which of the tokens a vLLM MoE router sees are this process's own, under vLLM's parallel layouts,
and which shard of its EP group's window this process writes (the shard contract: a shard is an
ordinary Window with a top-level `shard` object {index, count, rank, sequence}).

A process routes the whole group's tokens only when vLLM runs one DP rank without sequence-parallel
MoE: then every TP rank routes every token, and TP rank 0 reports them all (no shard). Otherwise:
- DP attention (data_parallel_size > 1, with or without EP): each DP rank schedules its own
  requests; its MoE routers see its own rows (a kernel that dispatches inside the quant method) or
  every DP rank's rows gathered before routing (vLLM's naive dispatch, quant methods without an
  internal kernel). TP rank 0 of each DP rank counts that DP rank's real rows: one shard per DP rank.
- Sequence-parallel MoE (DP > 1, TP > 1, EP, an all-to-all backend): vLLM chunks each DP rank's
  rows across its TP ranks before the MoE layer (`sequence_parallel_chunk`: padded to a multiple of
  TP, chunk t is rows [t*c, (t+1)*c)); a router sees its chunk, or every chunk of the EP group
  gathered in DP-then-TP order (`DPMetadata.local_sizes`). Every TP rank counts the real rows of its
  own chunk: one shard per (DP rank, TP rank).
The rows are read from vLLM's forward context as vLLM's own routed-experts capture reads them
(per-rank token counts `num_tokens_across_dp_cpu` and the gathered chunk sizes `local_sizes`).
The real rows among them are the step's scheduled tokens (the pair weights armed for them); under
dual batch overlap each micro-batch runs the router once with its own forward context, whose
`is_padding` marks its padded rows (the last micro-batch holds the padding).

Sizes: n rows a router was called with, k experts per token, D DP ranks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

logger = logging.getLogger("moewatch.vllm")


@dataclass(frozen=True)
class ShardLayout:
    """This process's place in its EP group. index in [0, count): its shard; rank: the EP rank whose
    tokens it routes (the source rank of its pairs; 0 without EP, where the group is one rank)."""

    index: int
    count: int
    rank: int
    dp_rank: int
    tp_rank: int
    tp_size: int
    sequence_parallel: bool

    def shard(self, sequence: int) -> dict:
        return {"index": self.index, "count": self.count, "rank": self.rank, "sequence": int(sequence)}


def shard_layout(*, dp_size: int, dp_rank: int, tp_size: int, tp_rank: int, sp_size: int, use_ep: bool,
                 ep_rank: int) -> ShardLayout | None:
    """The shard this process writes, from vLLM's MoE parallel config (FusedMoEParallelConfig: dp,
    sp, EP rank) and its attention TP rank; None when it routes all of its group's tokens."""
    sequence_parallel = sp_size > 1
    if dp_size <= 1 and not sequence_parallel:
        return None
    per_dp_rank = sp_size if sequence_parallel else 1
    return ShardLayout(index=dp_rank * per_dp_rank + (tp_rank if sequence_parallel else 0),
                       count=max(dp_size, 1) * per_dp_rank, rank=ep_rank if use_ep else 0, dp_rank=dp_rank,
                       tp_rank=tp_rank, tp_size=max(tp_size, 1), sequence_parallel=sequence_parallel)


def local_rows(n: int, tokens_across_dp: Sequence[int], dp_rank: int, chunk_sizes: Sequence[int] | None,
               tp_rank: int, tp_size: int, sequence_parallel: bool) -> tuple[int, int, int] | None:
    """Where this process's own rows are among the n rows a router was called with.

    tokens_across_dp [D]: each DP rank's rows in this forward (or micro-batch), padding included;
    chunk_sizes: the sequence-parallel chunk of every (DP rank, TP rank), DP-then-TP, when vLLM set
    them. Returns (first, count, offset): rows [first, first + count) are this process's, and are
    rows [offset, offset + count) of its DP rank's batch; None for a layout this reading does not know."""
    local = int(tokens_across_dp[dp_rank])
    if sequence_parallel:
        if chunk_sizes is not None and len(chunk_sizes) == len(tokens_across_dp) * tp_size \
                and n == sum(chunk_sizes):  # every chunk of the EP group gathered (naive dispatch)
            mine = dp_rank * tp_size + tp_rank
            return int(sum(chunk_sizes[:mine])), int(chunk_sizes[mine]), tp_rank * int(chunk_sizes[mine])
        if n == -(-local // tp_size):  # this TP rank's chunk alone
            return 0, n, tp_rank * n
        return None
    if n == sum(int(t) for t in tokens_across_dp):  # every DP rank's rows gathered before routing
        return int(sum(int(t) for t in tokens_across_dp[:dp_rank])), local, 0
    if n == local:
        return 0, n, 0
    return None


def ranks_per_node(parallel_config, world_size: int) -> int:
    """How many ranks of the EP group share a node, from vLLM's parallel config: the DP ranks this
    node runs (data_parallel_size_local) times each one's TP x PCP ranks on this node (a DP replica
    spans nnodes_within_dp nodes). The whole group when that does not divide it."""
    try:
        per_replica = parallel_config.tensor_parallel_size * getattr(parallel_config, "prefill_context_parallel_size", 1)
        per_replica //= max(int(parallel_config.nnodes_within_dp), 1)
        on_node = max(per_replica, 1) * max(int(parallel_config.data_parallel_size_local), 1)
    except (AttributeError, TypeError, ValueError):
        return world_size
    on_node = min(on_node, world_size)
    return on_node if on_node >= 1 and world_size % on_node == 0 else world_size


def own_rows(layout: ShardLayout, weights, on_unknown):
    """rows(topk_ids) -> (first, count, pair weights [count * k]): rows [first, first + count) of the
    router's [n, k] ids are this process's own; None: count nothing.

    `weights` is the process's PairWeights: ones over the first real rows of its DP rank's batch
    while a step runs. Outside dual batch overlap the weights are a view of that buffer at the rows'
    offset (no allocation; the offsets are fixed when a CUDA graph is captured, which holds because
    under CUDA graphs vLLM pads every DP rank to the same batch size, at capture and at replay);
    inside a micro-batch they are its forward context's non-padding rows, times the buffer's first
    entry (zero outside real steps). `on_unknown(reason)` is called for a layout not understood."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    try:
        from vllm.v1.worker.ubatching import dbo_enabled
    except ImportError:  # a build without micro-batching
        def dbo_enabled() -> bool:
            return False

    buffer, k = weights.tensor, weights.top_k

    def rows(topk_ids):
        ctx = get_forward_context() if is_forward_context_available() else None
        dp = ctx.dp_metadata if ctx is not None else None
        if dp is None:  # no DP metadata (a single DP rank's own batch)
            return 0, topk_ids.shape[0], buffer[:topk_ids.shape[0] * k]
        n = topk_ids.shape[0]
        where = local_rows(n, dp.num_tokens_across_dp_cpu.tolist(), layout.dp_rank, dp.local_sizes,
                           layout.tp_rank, layout.tp_size, layout.sequence_parallel)
        if where is None:
            on_unknown(f"a router saw {n} rows, not a layout of DP rank {layout.dp_rank}'s tokens "
                       f"(per DP rank {dp.num_tokens_across_dp_cpu.tolist()}, chunks {dp.local_sizes})")
            return None
        first, count, offset = where
        padding = getattr(ctx, "is_padding", None)
        if padding is not None and dbo_enabled():
            return first, count, micro_batch_weights(padding, offset, count, k, buffer[:1])
        return first, count, buffer[offset * k:(offset + count) * k]

    return rows


def micro_batch_weights(is_padding, offset: int, count: int, top_k: int, armed):
    """[count * k] pair weights of rows [offset, offset + count) of a micro-batch: 1 for its real rows
    (is_padding False), 0 for padding and for rows past its end, times `armed` ([1]: 1 in a real step)."""
    import torch

    real = (~is_padding[offset:offset + count]).to(armed.dtype)
    if real.shape[0] < count:  # sequence-parallel padding past the micro-batch's rows
        real = torch.nn.functional.pad(real, (0, count - real.shape[0]))
    return real.repeat_interleave(top_k) * armed
