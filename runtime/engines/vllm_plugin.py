"""moewatch inside vLLM: a `vllm.general_plugins` entry point (pyproject.toml) that counts the
pairs each MoE layer routes and writes Windows (runtime "vllm") to the agent's socket or a folder.

Inactive unless MOEWATCH_SOCKET or MOEWATCH_WINDOW_DIR is set (common.EngineSettings). When active,
`register()` (run by vLLM in each of its processes) wraps three things, nothing else:
- the MoE layer's constructor: each MoERunner built from then on gets a capture function on its
  router, bound once at construction and never unbound. vLLM calls it with the logical top-k ids
  [N, k] before any EPLB mapping; it adds them into preallocated device counters (PairCounter), a
  pure tensor op that torch.compile and CUDA graphs keep. Only the reporting rank binds: TP rank 0
  of its group (every TP rank routes every token, so one rank's counts are the group's). A router
  has one capture slot, which vLLM's own routed-experts capture (enable_return_routed_experts) also
  binds, after the model is built: the slot is shared (`_share_capture_slot`), so moewatch's counter
  and any other capture function both run, whichever was bound first.
- the model runner's `execute_model` (V1's, and V2's where this vLLM has it: enable_return_routed_experts
  needs V2): a step with scheduled tokens arms the pair weights for its real tokens before the
  forward and disarms them after, so warm-up, profiling, compile and dummy runs (which pass through
  here without tokens, or as V2's dummy_run) and padding count nothing; the window is flushed every
  MOEWATCH_WINDOW_STEPS steps or MOEWATCH_WINDOW_SECONDS.
- the worker's `shutdown` (and process exit): the last, partial window is flushed.

Measured: pairs per layer and logical expert for computed tokens (prefix-cache hits are not
computed, so not counted); tokens per step; on the CPU with enforce_eager, per-layer MoE time and
per-step time by perf_counter (the CPU runs synchronously, so these cost no sync). GPU only, not
testable on a CPU machine: with EPLB, pairs per physical slot (the ids after vLLM's mapping) and the
physical_to_logical_map in force; per-step time from CUDA events recorded around each step and read
only once complete (clock.py: no host sync; a window waits for its steps' events, or goes without
them). Absent: dispatch/combine/compute split, rank-level traffic, and per-layer time on a GPU.
"""

from __future__ import annotations

import atexit
import logging
import os
import time

import numpy as np

RUNTIME_NAME = "vllm"
logger = logging.getLogger("moewatch.vllm")

_state: dict = {"registered": False, "recorder": None}


def register() -> None:
    """The entry point. Idempotent (vLLM may load plugins more than once per process)."""
    from . import vllm_eplb
    from .common import EngineSettings

    vllm_eplb.install_from_env()  # MOEWATCH_EPLB=1: moewatch's planner as vLLM's EPLB policy (vllm_eplb.py)
    settings = EngineSettings.from_env()
    if settings is None or _state["registered"]:
        return
    _state["registered"] = True
    _state["settings"] = settings
    try:
        _wrap_runner_constructor()
        _wrap_execute_model()
        _wrap_shutdown()
    except (ImportError, AttributeError) as exc:  # another vLLM layout: serve unobserved, say why
        logger.warning("moewatch: this vLLM does not have the hooks the plugin binds to (%s); not observing", exc)
        return
    atexit.register(close)


def recorder():
    """This process's recorder (None before the first MoE layer was built, or on a non-reporting rank)."""
    return _state["recorder"]


def close() -> None:
    rec = _state.get("recorder")
    if rec is not None:
        rec.close()


# --- binding at construction -------------------------------------------------------------------------

def _reporting_rank() -> bool:
    from vllm.distributed import parallel_state as ps

    try:
        return ps.get_tensor_model_parallel_rank() == 0 and ps.get_pp_group().rank_in_group == 0
    except AssertionError:  # parallel state not set up: a single process
        return True


def _recorder_for(moe_config):
    """The process's recorder, created at the first MoE layer from vLLM's config in scope."""
    rec = _state["recorder"]
    if rec is not None:
        return rec
    import torch
    from vllm.config import get_current_vllm_config

    from .clock import EventClock, cuda_event_factory
    from .common import EngineRecorder, PairWeights

    vcfg = get_current_vllm_config()
    settings = _state["settings"]
    device = torch.device(moe_config.device) if moe_config.device is not None else torch.device("cpu")
    parallel = moe_config.moe_parallel_config
    # A router may see the batches of its whole DP or EP group gathered: room for all of them, so a
    # pair never lacks its weight (the slice must match the ids, or the step would fail).
    max_tokens = vcfg.scheduler_config.max_num_batched_tokens * max(
        parallel.ep_size if parallel.use_ep else parallel.dp_size, 1)
    world = parallel.ep_size if parallel.use_ep else 1
    ep_group = settings.ep_group if parallel.dp_size <= 1 else f"{settings.ep_group}-dp{parallel.dp_rank}"
    model = settings.model or _model_name(vcfg)
    element = torch.empty((), dtype=moe_config.in_dtype).element_size()
    on_cpu = device.type == "cpu"
    eager = bool(vcfg.model_config.enforce_eager)
    from dataclasses import replace
    rec = EngineRecorder(
        replace(settings, ep_group=ep_group), runtime=RUNTIME_NAME, model=model, top_k=moe_config.experts_per_token,
        hidden_bytes=moe_config.hidden_dim * element, num_experts=moe_config.num_logical_experts,
        weights=PairWeights(max_tokens, moe_config.experts_per_token, device), world_size=world,
        time_steps=on_cpu, clock=EventClock(cuda_event_factory()) if device.type == "cuda" else None)
    if on_cpu and eager:
        rec.layer_seconds = {}
    from . import vllm_eplb
    rec.extra_fields["engine_rebalance"] = vllm_eplb.take_records  # the EPLB policy's decisions, when it is on
    _state["recorder"] = rec
    _state["time_layers"] = on_cpu and eager
    return rec


def _model_name(vcfg) -> str:
    name = vcfg.model_config.served_model_name
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return str(name or os.path.basename(str(vcfg.model_config.model).rstrip("/")) or "model")


def _bind(runner) -> None:
    """Give one MoERunner its counter: capture on the router (logical ids), and with EPLB on a GPU
    also the physical ids after vLLM's mapping."""
    router = getattr(runner, "router", None)
    if router is None or not hasattr(router, "set_capture_fn") or not _reporting_rank():
        return
    rec = _recorder_for(runner.moe_config)
    layer_id = runner.layer_id
    eplb = getattr(router, "eplb_state", None)
    num_slots = runner.moe_config.num_experts if eplb is not None else 0
    counter = rec.counter(layer_id, num_slots)
    _share_capture_slot(router, counter.add)
    if eplb is not None:
        _count_slots(router, counter, rec)
    if _state.get("time_layers"):
        _time_layer(runner, layer_id, rec)


def _share_capture_slot(router, count) -> None:
    """Make the router's one capture slot run `count` and whatever else is bound there, now or later.

    What is bound already is composed with `count`; the router's `set_capture_fn` is replaced, on this
    instance only, by one that composes what a later caller binds (vLLM's routed-experts capturer
    binds after the model is built) instead of dropping `count`; binding None leaves `count` alone.
    The composition is built at bind time, so a forward calls two functions and allocates nothing."""
    bind = router.set_capture_fn  # the class's method, bound to this router

    def composed(other):
        other = getattr(other, "_moewatch_other", other)  # a caller re-binding what it read back
        if other is None or other == count:
            return count

        def capture(topk_ids):
            count(topk_ids)
            other(topk_ids)

        capture._moewatch_other = other
        return capture

    def set_capture_fn(capture_fn) -> None:
        bind(composed(capture_fn))

    set_capture_fn(getattr(router, "capture_fn", None))
    router.set_capture_fn = set_capture_fn


def _count_slots(router, counter, rec) -> None:
    # GPU only (vLLM's EPLB is CUDA-only): the mapped ids are what each slot computes.
    mapping = router._apply_eplb_mapping

    def mapped(topk_ids):
        physical = mapping(topk_ids)
        counter.add_slots(physical)
        return physical

    router._apply_eplb_mapping = mapped
    if rec.slot_map is None:
        rec.slot_map = _eplb_map


def _eplb_map() -> np.ndarray:
    runner = _state.get("model_runner")
    states = runner.eplb_state.model_states
    return next(iter(states.values())).physical_to_logical_map.cpu().numpy()


def _time_layer(runner, layer_id: int, rec) -> None:
    # CPU eager only: perf_counter around the layer's forward measures it without any sync.
    forward = runner.forward

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        seconds = rec.layer_seconds
        seconds[layer_id] = seconds.get(layer_id, 0.0) + (time.perf_counter() - start)
        return out

    runner.forward = timed


def _wrap_once(cls, name: str, make) -> None:
    """Replace cls.name by make(original), once per process (vLLM may load plugins again)."""
    original = getattr(cls, name)
    if getattr(original, "_moewatch", False):
        return
    wrapped = make(original)
    wrapped._moewatch = True
    setattr(cls, name, wrapped)


def _wrap_runner_constructor() -> None:
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    def make(init):
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            try:
                _bind(self)
            except Exception:  # never stop the engine from starting: log why it is not observed
                logger.exception("moewatch: could not bind to MoE layer %s", getattr(self, "layer_name", "?"))
        return __init__

    _wrap_once(MoERunner, "__init__", make)


# --- steps and shutdown ------------------------------------------------------------------------------

def _wrap_execute_model() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap_once(GPUModelRunner, "execute_model", lambda execute: _counting_steps(execute, dummy_runs=False))
    try:  # Model Runner V2 (what enable_return_routed_experts needs): its dummy runs pass through here
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
    except ImportError:  # a build without it: the V1 runner is the only one
        return
    _wrap_once(GPUModelRunnerV2, "execute_model", lambda execute: _counting_steps(execute, dummy_runs=True))


def _counting_steps(execute, *, dummy_runs: bool):
    """execute_model that makes a step of each call with scheduled tokens, arming the pair weights for
    them. With `dummy_runs`, the runner also calls it for warm-up and profiling (dummy_run=True, its
    third parameter), which counts nothing."""
    def execute_model(self, scheduler_output, *args, **kwargs):
        rec = _state["recorder"]
        tokens = scheduler_output.total_num_scheduled_tokens if rec is not None else 0
        if dummy_runs and kwargs.get("dummy_run", len(args) > 1 and args[1]):
            tokens = 0
        if tokens <= 0:
            return execute(self, scheduler_output, *args, **kwargs)
        _state["model_runner"] = self
        rec.begin_step(tokens)
        try:
            return execute(self, scheduler_output, *args, **kwargs)
        finally:
            rec.end_step()
    return execute_model


def _wrap_shutdown() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    def make(shutdown):
        def worker_shutdown(self, *args, **kwargs):
            close()
            return shutdown(self, *args, **kwargs)
        return worker_shutdown

    _wrap_once(Worker, "shutdown", make)
