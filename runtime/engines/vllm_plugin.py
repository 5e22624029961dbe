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
  here without tokens, or as V2's dummy_run) and padding count nothing; with `sample_tokens` (both
  runners') it marks the step: from execute_model's start to sample_tokens' end (sampler, MTP
  drafter and EPLB step included). The window ends every MOEWATCH_WINDOW_STEPS steps or
  MOEWATCH_WINDOW_SECONDS, the latter also while the engine is idle (the recorder's timer); its
  counters reach the host by a non-blocking copy read once complete (readout.py: no host sync).
- the worker's `shutdown` (and process exit): the last, partial window is flushed.

Measured: pairs per layer and logical expert for computed tokens (prefix-cache hits are not
computed, so not counted); tokens per step; on the CPU with enforce_eager, per-layer MoE time and
per-step time by perf_counter (the CPU runs synchronously, so these cost no sync). GPU only, not
testable on a CPU machine: with EPLB, pairs per physical slot (the ids after vLLM's mapping) and the
physical_to_logical_map in force (copied with the counters, no sync); per-step time from CUDA events
recorded around each step and read only once complete (clock.py: no host sync; a window waits for
its steps' events, or goes without them). Absent: dispatch/combine/compute split, rank-level
traffic, and per-layer time on a GPU.
"""

from __future__ import annotations

import atexit
import logging
import os
import time

from . import vllm_layout

RUNTIME_NAME = "vllm"
logger = logging.getLogger("moewatch.vllm")

_state: dict = {"registered": False, "recorder": None}


def register() -> None:
    """The entry point. Idempotent (vLLM may load plugins more than once per process)."""
    from . import vllm_eplb
    from .common import EngineSettings

    vllm_eplb.install_from_env()  # MOEWATCH_EPLB=1: moewatch's planner as vLLM's EPLB policy (vllm_eplb.py)
    try:
        settings = EngineSettings.from_env()
    except ValueError as exc:  # a malformed MOEWATCH_ variable: the engine serves unobserved, the log names it
        observation_off(str(exc))
        return
    if settings is None or _state["registered"]:
        return
    _state["registered"] = True
    _state["settings"] = settings
    try:
        _wrap_runner_constructor()
        _wrap_execute_model()
        _wrap_shutdown()
        _wrap_lockstep_and_warm_up()
    except (ImportError, AttributeError) as exc:  # another vLLM layout: serve unobserved, say why
        observation_off(f"this vLLM does not have the hooks the plugin binds to ({type(exc).__name__}: {exc})")
        return
    atexit.register(close)


def observation_off(reason: str) -> None:
    """Stop observing, with one warning naming vLLM's version and why: the steps pass through
    untouched from then on (counters already bound stay disarmed and add nothing), and the engine
    keeps serving."""
    if _state.get("off"):
        return
    _state["off"] = reason
    try:
        from vllm import __version__ as version
    except Exception:  # a build without a version string
        version = "(unknown version)"
    logger.warning("moewatch: observation is off for vLLM %s: %s; the engine keeps serving unobserved",
                   version, reason)


def recorder():
    """This process's recorder (None before the first MoE layer was built, or on a non-reporting rank)."""
    return _state["recorder"]


def close() -> None:
    _end_open_step()
    rec = _state.get("recorder")
    if rec is not None:
        rec.close()


# --- binding at construction -------------------------------------------------------------------------

def _reporting_rank(moe_config) -> bool:
    """TP rank 0 (of pipeline stage 0), where every TP rank routes every token; every TP rank where
    vLLM chunks the tokens across TP before the MoE layer (sequence-parallel MoE: each routes its chunk)."""
    from vllm.distributed import parallel_state as ps

    sequence_parallel = moe_config.moe_parallel_config.sp_size > 1
    try:
        return (sequence_parallel or ps.get_tensor_model_parallel_rank() == 0) and ps.get_pp_group().rank_in_group == 0
    except AssertionError:  # parallel state not set up: a single process
        return True


def _tp_rank() -> int:
    from vllm.distributed import parallel_state as ps

    try:
        return ps.get_tensor_model_parallel_rank()
    except AssertionError:  # parallel state not set up: a single process
        return 0


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
    # Under DP attention or sequence-parallel MoE this process routes a share of its group's tokens:
    # it writes one shard of the group's window (vllm_layout.py), never a group of its own.
    layout = vllm_layout.shard_layout(
        dp_size=parallel.dp_size, dp_rank=parallel.dp_rank, tp_size=vcfg.parallel_config.tensor_parallel_size,
        tp_rank=_tp_rank(), sp_size=parallel.sp_size, use_ep=parallel.use_ep, ep_rank=parallel.ep_rank)
    if layout is not None:
        settings = _lockstep_settings(settings)
    model = settings.model or _model_name(vcfg)
    element = torch.empty((), dtype=moe_config.in_dtype).element_size()
    on_cpu = device.type == "cpu"
    eager = bool(vcfg.model_config.enforce_eager)
    rec = EngineRecorder(
        settings, runtime=RUNTIME_NAME, model=model, top_k=moe_config.experts_per_token,
        hidden_bytes=moe_config.hidden_dim * element, num_experts=moe_config.num_logical_experts,
        weights=PairWeights(max_tokens, moe_config.experts_per_token, device), world_size=world,
        time_steps=on_cpu, clock=EventClock(cuda_event_factory()) if device.type == "cuda" else None)
    if on_cpu and eager:
        rec.layer_seconds = {}
    rec.ranks_per_node = vllm_layout.ranks_per_node(vcfg.parallel_config, world)
    _state["layout"] = layout
    if layout is not None:
        _count_lockstep_steps(rec, layout, settings.window_steps)
    from . import vllm_eplb
    rec.extra_fields["engine_rebalance"] = vllm_eplb.take_records  # the EPLB policy's decisions, when it is on
    _state["recorder"] = rec
    _state["time_layers"] = on_cpu and eager
    return rec


def _lockstep_settings(settings):
    """A shard's window ends after window_steps of the steps every DP rank runs in lockstep (see
    _count_lockstep_steps), never on a clock: ranks cannot agree on a wall-clock end without a
    collective. MOEWATCH_WINDOW_SECONDS alone is taken as the default step count, with a warning."""
    from dataclasses import replace

    from .common import DEFAULT_WINDOW_STEPS, ENV_WINDOW_SECONDS, ENV_WINDOW_STEPS

    if settings.window_steps is None:
        logger.warning("moewatch: under data parallelism a window is %s lockstep steps (default %d); "
                       "%s is not used, as DP ranks cannot agree on a wall-clock end", ENV_WINDOW_STEPS,
                       DEFAULT_WINDOW_STEPS, ENV_WINDOW_SECONDS)
    return replace(settings, window_steps=settings.window_steps or DEFAULT_WINDOW_STEPS, window_seconds=None)


def _count_lockstep_steps(rec, layout, window_steps: int) -> None:
    """Give each shard its window sequence without a collective. vLLM's DP engine core runs one
    forward per busy-loop iteration on every DP rank at once (their collectives pair them): a step
    with scheduled tokens through execute_model, or `execute_dummy_batch` on a rank with none. Both
    are steps here (the dummy one with 0 tokens and counting nothing, _wrap_lockstep_and_warm_up), so
    every DP rank counts the same steps, its windows end at the same step counts, and the i-th step
    since start is in window i // window_steps on every rank: that is the sequence."""
    begin = rec.begin_step
    _state["lockstep_steps"] = 0
    _state["sequence"] = 0

    def begin_step(num_tokens: int) -> None:
        _state["sequence"] = _state["lockstep_steps"] // window_steps
        _state["lockstep_steps"] += 1
        begin(num_tokens)

    rec.begin_step = begin_step
    rec.extra_fields["shard"] = lambda: layout.shard(_state["sequence"])


def _model_name(vcfg) -> str:
    name = vcfg.model_config.served_model_name
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return str(name or os.path.basename(str(vcfg.model_config.model).rstrip("/")) or "model")


def _bind(runner) -> None:
    """Give one MoERunner its counter: capture on the router (logical ids), and with EPLB on a GPU
    also the physical ids after vLLM's mapping."""
    router = getattr(runner, "router", None)
    if router is None or not hasattr(router, "set_capture_fn") or not _reporting_rank(runner.moe_config):
        return
    rec = _recorder_for(runner.moe_config)
    layer_id = runner.layer_id
    eplb = getattr(router, "eplb_state", None)
    num_slots = runner.moe_config.num_experts if eplb is not None else 0
    counter = rec.counter(layer_id, num_slots)
    rows = None
    if _state.get("layout") is not None:  # a share of the group's tokens: count this process's own rows
        rows = vllm_layout.own_rows(_state["layout"], rec.weights, observation_off)
        _share_capture_slot(router, _counting_own_rows(counter.add, rows))
    else:
        _share_capture_slot(router, counter.add)
    if eplb is not None:
        _count_slots(router, counter, rec, rows)
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


def _counting_own_rows(add, rows):
    """A capture function that counts only the rows `rows` (vllm_layout.own_rows) selects (row-aligned
    tensors passed with the ids, such as the router's weights, are sliced alike)."""
    def count(topk_ids, *row_aligned):
        own = rows(topk_ids)
        if own is not None:
            first, count, weights = own
            add(topk_ids[first:first + count], *(t[first:first + count] for t in row_aligned),
                pair_weights=weights)
    return count


def _count_slots(router, counter, rec, rows=None) -> None:
    # GPU only (vLLM's EPLB is CUDA-only): the mapped ids are what each slot computes.
    mapping = router._apply_eplb_mapping
    add_slots = counter.add_slots if rows is None else _counting_own_rows(counter.add_slots, rows)

    def mapped(topk_ids):
        physical = mapping(topk_ids)
        add_slots(physical)
        return physical

    router._apply_eplb_mapping = mapped
    if rec.slot_map is None:
        rec.slot_map = _eplb_map


def _eplb_map():
    # The device tensor itself: the flush copies it with the counters, without a host sync.
    runner = _state.get("model_runner")
    states = runner.eplb_state.model_states
    return next(iter(states.values())).physical_to_logical_map


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
                if not _state.get("off"):
                    _bind(self)
            except Exception as exc:  # never stop the engine from starting: it serves unobserved, and says why
                observation_off(f"could not bind to MoE layer {getattr(self, 'layer_name', '?')} "
                                f"({type(exc).__name__}: {exc})")
        return __init__

    _wrap_once(MoERunner, "__init__", make)


# --- steps and shutdown ------------------------------------------------------------------------------

def _wrap_execute_model() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap_once(GPUModelRunner, "execute_model", lambda execute: _counting_steps(execute, dummy_runs=False))
    _wrap_once(GPUModelRunner, "sample_tokens", _ending_steps)
    try:  # Model Runner V2 (what enable_return_routed_experts needs): its dummy runs pass through here
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
    except ImportError:  # a build without it: the V1 runner is the only one
        return
    _wrap_once(GPUModelRunnerV2, "execute_model", lambda execute: _counting_steps(execute, dummy_runs=True))
    _wrap_once(GPUModelRunnerV2, "sample_tokens", _ending_steps)


def _recorder_call(method, *args) -> bool:
    """Call the recorder; a failure turns observation off (one warning) instead of failing the step."""
    try:
        method(*args)
        return True
    except Exception as exc:
        observation_off(f"the recorder failed in {method.__name__} ({type(exc).__name__}: {exc})")
        return False


def _counting_steps(execute, *, dummy_runs: bool):
    """execute_model that makes a step of each call with scheduled tokens, arming the pair weights for
    them. With `dummy_runs`, the runner also calls it for warm-up and profiling (dummy_run=True, its
    third parameter), which counts nothing.

    The step is the engine's whole step: when execute_model leaves its state for sample_tokens (it
    returns None with `execute_model_state` set: the sampler, the MTP drafter and the EPLB step run
    there), the step stays open until sample_tokens returns (`_ending_steps`); the pair weights are
    disarmed as soon as the forward is launched, so what sample_tokens runs counts no pairs."""
    def execute_model(self, scheduler_output, *args, **kwargs):
        _end_open_step()  # a step whose sample_tokens never came (its execute_model failed): ended here
        rec = _state["recorder"]
        tokens = scheduler_output.total_num_scheduled_tokens if rec is not None else 0
        if dummy_runs and kwargs.get("dummy_run", len(args) > 1 and args[1]):
            tokens = 0
        if _state.get("warming_up"):  # Model Runner V2's warm-up sends realistic steps: not served
            tokens = 0
        if tokens <= 0 or _state.get("off") or not _recorder_call(rec.begin_step, tokens):
            return execute(self, scheduler_output, *args, **kwargs)
        _state["model_runner"] = self
        sampling_follows = False
        try:
            out = execute(self, scheduler_output, *args, **kwargs)
            sampling_follows = out is None and getattr(self, "execute_model_state", None) is not None
            return out
        finally:
            if sampling_follows and _recorder_call(rec.end_forward):
                _state["open_step"] = rec
            else:
                _recorder_call(rec.end_step)
    return execute_model


def _end_open_step() -> None:
    rec = _state.pop("open_step", None)
    if rec is not None:
        _recorder_call(rec.end_step)


def _ending_steps(sample):
    """sample_tokens that ends the step its execute_model left open (see _counting_steps)."""
    def sample_tokens(self, *args, **kwargs):
        try:
            return sample(self, *args, **kwargs)
        finally:
            _end_open_step()
    return sample_tokens


def _wrap_lockstep_and_warm_up() -> None:
    """The worker's `execute_dummy_batch` (a DP rank with nothing scheduled, in step with the others):
    a step of 0 tokens for a shard's lockstep count. The worker's warm-up and profiling
    (compile_or_warm_up_model, determine_available_memory, V1's and the CPU worker's): no execute_model
    call inside them is a served step (Model Runner V2's warm_up_kernels sends realistic scheduler
    outputs through execute_model, without dummy_run)."""
    from vllm.v1.worker.gpu_worker import Worker

    workers = [Worker]
    try:
        from vllm.v1.worker.cpu_worker import CPUWorker
        workers.append(CPUWorker)
    except ImportError:  # a build without the CPU worker
        pass

    def dummy_step(dummy):
        def execute_dummy_batch(self, *args, **kwargs):
            rec = _state["recorder"]
            if rec is None or _state.get("layout") is None or _state.get("off") \
                    or not _recorder_call(rec.begin_step, 0):
                return dummy(self, *args, **kwargs)
            try:
                return dummy(self, *args, **kwargs)
            finally:
                _recorder_call(rec.end_step)
        return execute_dummy_batch

    _wrap_once(Worker, "execute_dummy_batch", dummy_step)
    for cls in workers:
        for name in ("compile_or_warm_up_model", "determine_available_memory"):
            if name in vars(cls):
                _wrap_once(cls, name, _warming_up)


def _warming_up(method):
    def warm_up(self, *args, **kwargs):
        _state["warming_up"] = _state.get("warming_up", 0) + 1
        try:
            return method(self, *args, **kwargs)
        finally:
            _state["warming_up"] -= 1
    return warm_up


def _wrap_shutdown() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    def make(shutdown):
        def worker_shutdown(self, *args, **kwargs):
            close()
            return shutdown(self, *args, **kwargs)
        return worker_shutdown

    _wrap_once(Worker, "shutdown", make)
