"""What the SGLang hook needs to know of the server it runs in, read once from SGLang's published
configuration, and what follows from it: which counting path is right, whether this process reports,
and as which shard of its EP group's window.

Read (`read_layout`, inside an SGLang scheduler process, when SGLang calls the --forward-hooks factory):
the expert-distribution recorder in force (`get_global_expert_distribution_recorder`), whether CUDA
graphs run (`get_exec().graph`), two-batch overlap, the MoE runner backend and all-to-all backend
(`sglang.srt.layers.moe.utils`), and this process's ranks (`get_parallel()`). Everything after is
pure (`decide`), so the decisions are tested on any layout without a server.

Shards. Where SGLang routes each attention-DP rank's own tokens (`is_moe_input_scattered_across_dp_ranks`:
DeepEP and the other all-to-all backends, FlashInfer's FP4 all-gather, DWDP), every rank sends a shard
of its EP group's window: index = attention-DP rank, count = attention-DP size, rank = its MoE EP rank.
Elsewhere (TP, DP attention without an all-to-all backend, where SGLang gathers every DP rank's
tokens before the MoE) every rank routes the whole batch, so only TP rank 0 reports, unsharded.
The sequence all shards of one window share is the wall-clock bucket of the window length
(`window_sequence`): every rank's timer ends its window at the same multiples of window_seconds, no
collective; a pass that straddles a bucket edge may fall in neighbouring windows on two ranks, so a
window's merged counts can be off by that pass, and nothing is lost or counted twice over time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from . import sglang_routed

# Top-k formats that carry no expert ids: the MoE kernel routes from the logits itself, so neither a
# forward hook nor SGLang's recorder sees what it chose.
IDS_FREE_BACKENDS = {
    "triton_kernel": "the Triton-kernel top-k format (TritonKernelTopKOutput) carries no expert ids",
    "flashinfer_trtllm": ("FlashInfer TRT-LLM routes inside its kernel from the logits (BypassedTopKOutput has no "
                          "ids; deepseek_v2 calls TopK.forward_cuda directly, which no hook sees)"),
    "experimental_sgl_trtllm": "the TRT-LLM kernel routes inside itself from the logits (BypassedTopKOutput has no ids)",
    "flashinfer_mxfp4": "FlashInfer MXFP4 routes inside its kernel from the logits (BypassedTopKOutput has no ids)",
}

# Accumulators this hook may start recording itself: bounded memory and no host copy per pass.
SELF_STARTABLE_ACCUMULATORS = ("_StatAccumulator",)

# Gatherers whose counts are the pairs this rank's slots received from every rank (DeepEP's
# dispatch counts), not the pairs of the tokens this rank routed.
RECEIVED_COUNT_GATHERERS = ("_DeepepLowLatencySinglePassGatherer", "_DeepepNormalSinglePassGatherer")


@dataclass(frozen=True)
class SGLangLayout:
    """The facts of one SGLang process that decide how it is observed."""

    version: str
    recorder_mode: str | None  # --expert-distribution-recorder-mode; None: the recorder is off
    recording: bool  # the recorder records now (EPLB, balancedness reports or the operator started it)
    accumulator: str  # class name of the recorder's accumulator ("" without a recorder)
    gatherer: str  # class name of its primary single-pass gatherer
    bounded_buffer: bool  # the stat accumulator keeps a circular buffer (not -1: unbounded)
    routed_counts: bool  # the gatherer also counts this rank's routed pairs (sglang_routed.py)
    cuda_graphs: bool  # some forward passes replay CUDA graphs
    two_batch_overlap: bool
    runner_backend: str
    moe_input_scattered: bool  # each attention-DP rank routes its own tokens
    tp_rank: int
    tp_size: int
    pp_size: int
    nnodes: int
    attn_dp_rank: int
    attn_dp_size: int
    attn_tp_size: int
    moe_ep_rank: int
    moe_ep_size: int


@dataclass(frozen=True)
class Decision:
    """How this process is observed. `refusal`: observation off, for this reason (one warning);
    `reports` False: another rank of the group reports what this one routed (silently nothing)."""

    refusal: str | None = None
    reports: bool = False
    use_recorder: bool = False
    start_recording: bool = False
    shard: dict | None = None  # {"index", "count", "rank"}; the sequence is added per window
    ranks_per_node: int = 1
    counts_received: bool = False  # counts are what this rank's slots received (DeepEP dispatch)
    counts_padding: bool = False  # padded rows of a gathered DP batch are routed and counted


def decide(layout: SGLangLayout, *, num_layers: int, num_slots: int, ep_size: int,
           recorder_layers: int | None = None, recorder_slots: int | None = None) -> Decision:
    """The decision for a layout and the hook's config sizes (recorder_* from SGLang's expert-location
    metadata when a recorder is in force)."""
    backend = IDS_FREE_BACKENDS.get(layout.runner_backend)
    if backend is not None:
        return Decision(refusal=f"--moe-runner-backend {layout.runner_backend}: {backend}")
    if layout.pp_size > 1:
        return Decision(refusal=f"pipeline parallelism (pp_size {layout.pp_size}): each stage holds some layers, "
                                "which a window of the group does not describe")
    if ep_size != layout.moe_ep_size:
        return Decision(refusal=f"config.ep_size {ep_size} differs from SGLang's MoE EP size {layout.moe_ep_size}")
    use_recorder = layout.recorder_mode is not None
    if use_recorder:
        if (recorder_layers, recorder_slots) != (num_layers, num_slots):
            return Decision(refusal=f"config.num_layers/num_slots {num_layers}/{num_slots} differ from SGLang's "
                                    f"expert-location metadata {recorder_layers}/{recorder_slots}")
        start = not layout.recording
        if start and (layout.accumulator not in SELF_STARTABLE_ACCUMULATORS or not layout.bounded_buffer):
            return Decision(refusal=f"the expert-distribution recorder ({layout.recorder_mode}) is not recording, and "
                                    "starting it would keep every pass in memory; use --expert-distribution-recorder-"
                                    "mode stat with a --expert-distribution-recorder-buffer-size other than -1")
    else:
        if layout.cuda_graphs:
            return Decision(refusal="CUDA graph replay runs no forward hooks (SGLang registers them after capture), "
                                    "so decode would go uncounted; start SGLang with --expert-distribution-recorder-"
                                    "mode stat, whose counting runs inside the graphs")
        if layout.two_batch_overlap:
            return Decision(refusal="two-batch overlap runs top-k once per micro-batch, which a forward hook cannot "
                                    "tell from two steps; start SGLang with --expert-distribution-recorder-mode stat")
        start = False
    rpn = layout.moe_ep_size // layout.nnodes if layout.nnodes > 1 and layout.moe_ep_size % layout.nnodes == 0 \
        else layout.moe_ep_size
    received = use_recorder and layout.gatherer in RECEIVED_COUNT_GATHERERS and not layout.routed_counts
    common = dict(use_recorder=use_recorder, start_recording=start, ranks_per_node=rpn, counts_received=received)
    if not layout.moe_input_scattered:
        # SGLang masks no padded row of a batch gathered over attention-DP ranks (each rank's slot
        # is padded to the longest, ForwardBatch.moe_num_token_non_padded), so their pairs count.
        return Decision(reports=layout.tp_rank == 0 or (layout.tp_rank < 0 and layout.tp_size == 1),
                        counts_padding=layout.attn_dp_size > 1, **common)
    if layout.attn_tp_size > 1:
        return Decision(refusal=f"attention TP {layout.attn_tp_size} with each DP rank routing its own tokens: a "
                                "pass's rows are split over or replicated across attention-TP ranks per forward")
    if layout.attn_dp_size != layout.moe_ep_size:
        return Decision(refusal=f"attention-DP size {layout.attn_dp_size} differs from the MoE EP size "
                                f"{layout.moe_ep_size}")
    if min(layout.attn_dp_rank, layout.moe_ep_rank) < 0:
        return Decision(refusal="SGLang has not stamped this process's attention-DP and MoE EP ranks")
    shard = {"index": layout.attn_dp_rank, "count": layout.attn_dp_size, "rank": layout.moe_ep_rank}
    return Decision(reports=True, shard=shard, **common)


def window_sequence(unix_time: float, window_seconds: float) -> int:
    """The window (bucket of window_seconds since the epoch) that an instant falls in; every rank
    agrees on it from its own clock."""
    return int(math.floor(unix_time / window_seconds))


def read_layout() -> SGLangLayout:
    """The layout of the SGLang process this runs in (its configuration must be published)."""
    import sglang
    from sglang.srt.eplb import expert_distribution
    from sglang.srt.layers.moe import utils as moe_utils
    from sglang.srt.runtime_context import get_exec, get_parallel

    recorder = expert_distribution.get_global_expert_distribution_recorder()
    real = isinstance(recorder, expert_distribution._ExpertDistributionRecorderReal)
    accumulator = recorder._accumulator if real else None
    gatherer = recorder._single_pass_gatherers.get(expert_distribution._SINGLE_PASS_GATHERER_KEY_PRIMARY) \
        if real else None
    buffer = getattr(accumulator, "_global_physical_count_of_buffered_step", None)
    graph = get_exec().graph
    parallel = get_parallel()
    return SGLangLayout(
        version=getattr(sglang, "__version__", "unknown"),
        recorder_mode=get_exec().moe.expert_distribution_recorder_mode if real else None,
        recording=bool(real and recorder.recording),
        accumulator=type(accumulator).__name__ if real else "",
        gatherer=type(gatherer).__name__ if gatherer is not None else "",
        bounded_buffer=isinstance(buffer, expert_distribution._CircularBuffer),
        routed_counts=getattr(gatherer, sglang_routed.BUFFER, None) is not None,
        cuda_graphs=not graph.disable_cuda_graph and not (graph.disable_decode_cuda_graph
                                                          and graph.disable_prefill_cuda_graph),
        two_batch_overlap=bool(get_exec().overlap.enable_two_batch_overlap),
        runner_backend=str(getattr(moe_utils.get_moe_runner_backend(), "value", "auto")),
        moe_input_scattered=bool(moe_utils.is_moe_input_scattered_across_dp_ranks()),
        tp_rank=_rank(parallel, "tp_rank"), tp_size=int(parallel.tp_size), pp_size=int(parallel.pp_size),
        nnodes=int(parallel.nnodes), attn_dp_rank=_rank(parallel, "attn_dp_rank"),
        attn_dp_size=int(parallel.attn_dp_size), attn_tp_size=int(parallel.attn_tp_size),
        moe_ep_rank=_rank(parallel, "moe_ep_rank"), moe_ep_size=int(parallel.moe_ep_size))


def _rank(parallel: Any, name: str) -> int:
    """A rank SGLang stamps when it builds its groups; -1 where it has not."""
    try:
        return int(getattr(parallel, name))
    except (RuntimeError, ValueError, TypeError):
        return -1
