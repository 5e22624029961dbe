"""Runs inside .venv-vllm (the tests start it there): vLLM's own Python for the GPU branches of its
parallel layouts, on the CPU, with moewatch's plugin bound to each simulated process's router as
vLLM would bind it, and prints one JSON line per case.

Each case is a set of processes (DP rank d, TP rank t) of one EP group, with random router logits
for every row a rank runs, its real rows first and padding after (CUDA-graph / DP padding), so a
padding row counted shows. Per process: vLLM's CPU router (`CPURouter.select_experts`, which calls the
router's capture slot) routes the rows this layout hands it, under the forward context vLLM builds
(`DPMetadata.make`, `create_forward_context`, `override_forward_context`); moewatch binds through
`vllm_plugin._bind` on a stand-in MoE runner carrying vLLM's `FusedMoEParallelConfig`, under
`set_current_vllm_config`; one step (`begin_step` / `end_step`, window_steps=1) writes its window.
The vLLM functions that shape the rows:
- "dp_gathered": rows gathered across DP before routing (naive dispatch, a quant method without an
  internal kernel): every rank's rows concatenated in rank order (what the all-gatherv of
  `dispatch_router_logits` returns).
- "dp_own": a kernel that dispatches inside the quant method: the router sees the rank's rows.
- "sp_chunk": sequence-parallel MoE (DP 2 x TP 2, EP): vLLM's `sequence_parallel_chunk_impl`
  (models/utils.py) chunks each rank's rows across TP; routed inside `MoERunner._sequence_parallel_context`
  (which sets `DPMetadata.local_sizes` by `_compute_sp_num_tokens`).
- "sp_gathered": the same chunks gathered over the EP group in DP-then-TP order before routing.
- "dbo": dual batch overlap: vLLM's `maybe_create_ubatch_slices` splits each rank's padded batch,
  `GPUModelRunner._prepare_padding_mask` marks its padding, each micro-batch runs in its own thread
  inside a `UBatchContext` from `make_ubatch_contexts` (V1's `UBatchWrapper._run_ubatches` order)
  with the forward context the wrapper builds (per-micro-batch `DPMetadata`, `is_padding` sliced).
- "mrv2_warmup": Model Runner V2's `warmup_kernels` (gpu/warmup.py) drives execute_model with its
  realistic prefill and decode scheduler outputs, through the plugin's counting wrapper, while the
  worker warms up (`Worker.compile_or_warm_up_model`, wrapped by the plugin).

usage: vllm_layout_driver.py CASE [CASE ...]
"""

from __future__ import annotations

import json
import sys
import threading
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch

EXPERTS, TOP_K, HIDDEN = 8, 2, 16


def vllm_config(dp_size: int, dp_rank: int, tp_size: int = 1, ep: bool = True):
    from vllm.config import ParallelConfig, VllmConfig

    config = VllmConfig(parallel_config=ParallelConfig(
        data_parallel_size=dp_size, data_parallel_rank=dp_rank, tensor_parallel_size=tp_size,
        enable_expert_parallel=ep, data_parallel_size_local=dp_size))
    # No model to load here: what the plugin reads of the model's config (DPMetadata.make also asks
    # whether it is an MoE model).
    object.__setattr__(config, "model_config", SimpleNamespace(enforce_eager=False, served_model_name="tiny-moe"))
    return config


def moe_parallel(dp_size: int, dp_rank: int, tp_size: int, tp_rank: int, sp: bool):
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    world = dp_size * tp_size
    return FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=dp_size, ep_size=world, tp_rank=0, pcp_rank=0,
                                  dp_rank=dp_rank, ep_rank=dp_rank * tp_size + tp_rank,
                                  sp_size=tp_size if sp else 1, use_ep=True, all2all_backend="allgather_reducescatter",
                                  enable_eplb=False)


class Process:
    """One simulated vLLM worker process: moewatch's plugin state, its router and its windows."""

    def __init__(self, folder: str, dp_size: int, dp_rank: int, tp_size: int = 1, tp_rank: int = 0,
                 sp: bool = False, window_steps: int = 1):
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

        from moewatch.runtime.engines import vllm_plugin
        from moewatch.runtime.engines.common import EngineSettings

        self.plugin = vllm_plugin
        self.dp_rank, self.tp_rank, self.tp_size = dp_rank, tp_rank, tp_size
        self.config = vllm_config(dp_size, dp_rank, tp_size)
        vllm_plugin._state.clear()
        vllm_plugin._state.update(registered=True, recorder=None,
                                  settings=EngineSettings(window_dir=folder, window_steps=window_steps))
        self.router = CPURouter(top_k=TOP_K, global_num_experts=EXPERTS)
        moe_config = SimpleNamespace(device="cpu", moe_parallel_config=moe_parallel(dp_size, dp_rank, tp_size, tp_rank, sp),
                                     experts_per_token=TOP_K, in_dtype=torch.float32, hidden_dim=HIDDEN,
                                     num_logical_experts=EXPERTS, num_experts=EXPERTS)
        runner = SimpleNamespace(router=self.router, moe_config=moe_config, layer_id=0)
        with set_current_vllm_config(self.config), self.tp():
            vllm_plugin._bind(runner)
        self.state = dict(vllm_plugin._state)
        self.windows: list = []
        rec = self.state["recorder"]
        if rec is not None:
            rec.extra_sinks.append(self.windows.append)

    def tp(self):
        """vLLM's TP group as this process sees it (rank and size), where no process group is set up."""
        from vllm.distributed import parallel_state
        from vllm.model_executor.models import utils

        patches = [mock.patch.object(module, name, lambda value=value: value)
                   for module in (parallel_state, utils)
                   for name, value in (("get_tensor_model_parallel_rank", self.tp_rank),
                                       ("get_tensor_model_parallel_world_size", self.tp_size))]
        return _all(patches)

    def route(self, logits: torch.Tensor) -> None:
        self.router.select_experts(hidden_states=torch.zeros(logits.shape[0], HIDDEN), router_logits=logits)

    def step(self, real_tokens: int, forward) -> None:
        """One step of `real_tokens` scheduled tokens around `forward()` (which routes), as the plugin's
        execute_model wrapper runs it."""
        self.plugin._state.clear()
        self.plugin._state.update(self.state)
        rec = self.state["recorder"]
        if rec is None:  # not a reporting rank
            forward()
            return
        rec.begin_step(real_tokens)
        try:
            with self.tp():
                forward()
        finally:
            rec.end_step()
            self.state = dict(self.plugin._state)

    def dummy_batch(self) -> None:
        """vLLM's `Worker.execute_dummy_batch` (as the plugin wraps it), on a rank with nothing scheduled
        while another DP rank runs a step: its model runner's dummy run routes one row."""
        from vllm.forward_context import override_forward_context
        from vllm.v1.worker.gpu_worker import Worker

        self.plugin._state.clear()
        self.plugin._state.update(self.state)
        ctx = forward_context(self.config, [1, 1], self.dp_rank)

        def dummy_run(num_tokens, **kwargs):
            with override_forward_context(ctx):
                self.route(torch.randn(num_tokens, EXPERTS))

        worker = SimpleNamespace(model_runner=SimpleNamespace(_dummy_run=dummy_run, uniform_decode_query_len=1),
                                 randomize_dummy_inputs=False)
        Worker.execute_dummy_batch(worker)
        self.state = dict(self.plugin._state)

    def result(self) -> dict:
        rec = self.state["recorder"]
        if rec is not None:
            rec.close()
        return {"dp_rank": self.dp_rank, "tp_rank": self.tp_rank, "reporting": rec is not None,
                "windows": [{"expert_tokens": w.expert_tokens.tolist(), "ep_group": w.ep_group,
                             "world_size": w.world_size, "ranks_per_node": w.ranks_per_node,
                             "steps": w.steps, "step_tokens": w.step_tokens.tolist(),
                             "shard": w.extra.get("shard"), "json": w.to_json()} for w in self.windows]}


class _all:
    def __init__(self, managers):
        self.managers = managers

    def __enter__(self):
        for m in self.managers:
            m.__enter__()

    def __exit__(self, *exc):
        for m in reversed(self.managers):
            m.__exit__(*exc)
        return False


def batches(real: list[int], padded: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p, EXPERTS, generator=g) for p in padded]


def histogram(logits: list[torch.Tensor], real: list[int]) -> list[int]:
    """Pairs per expert over every rank's real rows: the top-k of their logits (vLLM's CPU router's rule)."""
    counts = np.zeros(EXPERTS, dtype=np.int64)
    for rows, r in zip(logits, real):
        counts += np.bincount(torch.topk(rows[:r], TOP_K, dim=-1).indices.reshape(-1).numpy(), minlength=EXPERTS)
    return counts.tolist()


def forward_context(config, tokens_across_dp: list[int], dp_rank: int, is_padding=None):
    from vllm.forward_context import DPMetadata, create_forward_context

    metadata = DPMetadata.make(config.parallel_config, tokens_across_dp[dp_rank],
                               torch.tensor(tokens_across_dp, dtype=torch.int32))
    return create_forward_context(None, config, dp_metadata=metadata, is_padding=is_padding)


def case_dp(folder: str, gathered: bool) -> dict:
    """DP attention + EP, DP 2, TP 1: rank 0 runs 5 real rows padded to 8, rank 1 runs 2 padded to 8."""
    from vllm.forward_context import override_forward_context

    real, padded = [5, 2], [8, 8]
    logits = batches(real, padded)
    everyone = torch.cat(logits)
    procs = [Process(folder, 2, d) for d in range(2)]
    for d, proc in enumerate(procs):
        ctx = forward_context(proc.config, padded, d)

        def forward(d=d, ctx=ctx, proc=proc):
            with override_forward_context(ctx):
                proc.route(everyone if gathered else logits[d])
        proc.step(real[d], forward)
    return {"expected": histogram(logits, real), "processes": [p.result() for p in procs]}


def case_sp(folder: str, gathered: bool) -> dict:
    """Sequence-parallel MoE, DP 2 x TP 2, EP 4: rank 0 runs 5 real rows of 7 (no graph padding: odd,
    so vLLM's chunking pads one row), rank 1 runs 3 real of 4."""
    from vllm.forward_context import override_forward_context
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.model_executor.models.utils import sequence_parallel_chunk_impl

    real, padded, tp = [5, 3], [7, 4], 2
    logits = batches(real, padded, seed=1)
    procs = {(d, t): Process(folder, 2, d, tp, t, sp=True) for d in range(2) for t in range(tp)}
    chunks = {}
    for (d, t), proc in procs.items():
        with proc.tp():
            chunks[(d, t)] = sequence_parallel_chunk_impl(logits[d])  # vLLM's chunk of rank d for TP rank t
    everyone = torch.cat([chunks[(d, t)] for d in range(2) for t in range(tp)])  # DP-then-TP
    for (d, t), proc in procs.items():
        ctx = forward_context(proc.config, padded, d)
        runner = SimpleNamespace(moe_config=SimpleNamespace(sp_size=tp, pcp_size=1, use_ep=True))

        def forward(d=d, t=t, ctx=ctx, proc=proc, runner=runner):
            with override_forward_context(ctx), MoERunner._sequence_parallel_context(runner):
                proc.route(everyone if gathered else chunks[(d, t)])
        proc.step(real[d], forward)
    return {"expected": histogram(logits, real), "processes": [p.result() for p in procs.values()]}


def case_dbo(folder: str) -> dict:
    """Dual batch overlap, DP 2, EP: each rank's batch padded to 128 rows (rank 0: 100 real in 4
    requests, rank 1: 70 real in 2), split in two micro-batches; the second holds the padding."""
    from vllm.forward_context import override_forward_context
    from vllm.v1.worker import ubatching
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.ubatch_utils import maybe_create_ubatch_slices

    real, padded = [100, 70], [128, 128]
    requests = [np.array([40, 30, 20, 10], dtype=np.int32), np.array([50, 20], dtype=np.int32)]
    logits = batches(real, padded, seed=2)
    procs = [Process(folder, 2, d) for d in range(2)]
    slices_seen = []
    stream = object()  # no device streams on the CPU: one stand-in for compute and communication
    for d, proc in enumerate(procs):
        _, slices = maybe_create_ubatch_slices(True, requests[d], padded[d], len(requests[d]), 2)
        slices_seen.append([[s.token_slice.start, s.token_slice.stop] for s in slices])
        mask_owner = SimpleNamespace(is_padding=torch.zeros(256, dtype=torch.bool))
        is_padding = GPUModelRunner._prepare_padding_mask(mask_owner, real[d], padded[d])
        contexts = [forward_context(proc.config, [s.num_tokens] * 2, d, is_padding[s.token_slice]) for s in slices]

        def forward(d=d, slices=slices, contexts=contexts, proc=proc):
            barrier = threading.Barrier(len(slices) + 1)
            with mock.patch.object(ubatching, "current_stream", lambda: stream), \
                    mock.patch.object(torch, "Event", lambda *a, **k: None):
                ubatch_contexts = ubatching.make_ubatch_contexts(len(slices), stream, stream, contexts, barrier)

                def run(i):
                    with ubatch_contexts[i]:
                        proc.route(logits[d][slices[i].token_slice])

                threads = [threading.Thread(target=run, args=(i,)) for i in range(len(slices))]
                with override_forward_context(None):
                    for thread in threads:
                        thread.start()
                    barrier.wait()
                    ubatch_contexts[0].cpu_wait_event.set()
                    for thread in threads:
                        thread.join()
        proc.step(real[d], forward)
    return {"expected": histogram(logits, real), "slices": slices_seen, "processes": [p.result() for p in procs]}


def case_mrv2_warmup(folder: str) -> dict:
    """Model Runner V2's warm-up: vLLM's `warmup_kernels` builds its prefill and decode scheduler
    outputs and hands them to the worker's execute_model (the plugin's counting wrapper around a
    stand-in forward), inside the worker's warm-up (`Worker.compile_or_warm_up_model` as the plugin
    wraps it); then one served step outside it."""
    from vllm.v1.worker.gpu import warmup
    from vllm.v1.worker.gpu_worker import Worker

    from moewatch.runtime.engines import vllm_plugin

    proc = Process(folder, 1, 0)
    vllm_plugin._state.clear()
    vllm_plugin._state.update(proc.state)
    vllm_plugin._wrap_execute_model()
    getattr(vllm_plugin, "_wrap_lockstep_and_warm_up", lambda: None)()  # absent before moewatch saw warm-ups
    seen: list[int] = []
    execute = vllm_plugin._counting_steps(lambda self, out, *a, **kw: seen.append(out.total_num_scheduled_tokens),
                                          dummy_runs=True)
    runner = SimpleNamespace(
        vllm_config=SimpleNamespace(is_mm_encoder_only=False, num_lookahead_tokens=0), max_model_len=256,
        is_last_pp_rank=False, num_speculative_steps=0, decode_query_len=1,
        is_pooling_model=False, kv_cache_config=SimpleNamespace(kv_cache_groups=[], num_blocks=64),
        model_state=SimpleNamespace(), is_encoder_decoder=False,
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64), kv_block_zeroer=None,
        kv_connector=SimpleNamespace(set_disabled=lambda disabled: None), adaptive_verification=None,
        rejection_sampler=None, req_states=None)
    errors: list[str] = []

    def warm_up_body(worker):
        try:
            warmup.warmup_kernels(runner, lambda out: execute(runner, out), lambda grammar: None)
        except Exception as exc:  # how far V2's warm-up runs on the CPU with these stand-ins
            errors.append(f"{type(exc).__name__}: {exc}")

    wrapped = getattr(vllm_plugin, "_warming_up", lambda method: method)(warm_up_body)
    with mock.patch.object(Worker, "compile_or_warm_up_model", wrapped):
        Worker.compile_or_warm_up_model(SimpleNamespace())
    rec = vllm_plugin._state["recorder"]
    steps_in_warm_up = rec.steps + rec.windows_built  # window_steps=1: a step would have made a window
    warm_up_tokens = list(seen)
    execute(runner, SimpleNamespace(total_num_scheduled_tokens=6))  # a served step
    return {"warm_up_tokens": warm_up_tokens, "warm_up_error": errors, "steps_in_warm_up": steps_in_warm_up,
            "steps_after_a_served_step": rec.steps + rec.windows_built,
            "compile_or_warm_up_model_wrapped": getattr(vars(Worker)["compile_or_warm_up_model"], "_moewatch", False)}


def case_lockstep(folder: str) -> dict:
    """DP 2, windows of 2 steps: rank 0 runs three steps; rank 1 runs one, then has nothing scheduled
    and takes part in the other two with vLLM's dummy batch. Both ranks' windows end at the same
    steps and carry the same sequences."""
    from vllm.forward_context import override_forward_context

    from moewatch.runtime.engines import vllm_plugin

    vllm_plugin._wrap_execute_model()
    getattr(vllm_plugin, "_wrap_lockstep_and_warm_up", lambda: None)()
    plan = [[3, 2, 4], [1, None, None]]  # tokens per step, None: a dummy batch
    logits = [[torch.randn(t, EXPERTS, generator=torch.Generator().manual_seed(10 * d + i)) if t else None
               for i, t in enumerate(steps)] for d, steps in enumerate(plan)]
    procs = [Process(folder, 2, d, window_steps=2) for d in range(2)]
    for i in range(3):
        across = [plan[d][i] or 1 for d in range(2)]
        for d, proc in enumerate(procs):
            if plan[d][i] is None:
                proc.dummy_batch()
                continue
            ctx = forward_context(proc.config, across, d)

            def forward(d=d, i=i, ctx=ctx, proc=proc):
                with override_forward_context(ctx):
                    proc.route(logits[d][i])
            proc.step(plan[d][i], forward)
    real = [t for steps in plan for t in steps if t]
    rows = [x for per_rank in logits for x in per_rank if x is not None]
    return {"expected": histogram(rows, real), "processes": [p.result() for p in procs]}


CASES = {
    "dp_gathered": lambda folder: case_dp(folder, gathered=True),
    "dp_own": lambda folder: case_dp(folder, gathered=False),
    "sp_chunk": lambda folder: case_sp(folder, gathered=False),
    "sp_gathered": lambda folder: case_sp(folder, gathered=True),
    "dbo": case_dbo,
    "mrv2_warmup": case_mrv2_warmup,
    "lockstep": case_lockstep,
}


def main() -> None:
    import tempfile

    for name in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as folder:
            out = CASES[name](folder)
        print(json.dumps({"case": name, **out}), flush=True)


if __name__ == "__main__":
    main()
