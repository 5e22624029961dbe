"""moewatch inside vLLM: a `vllm.general_plugins` entry point (pyproject.toml) that counts the
pairs each MoE layer routes and writes Windows (runtime "vllm") to the agent's socket or a folder.

Inactive unless MOEWATCH_SOCKET or MOEWATCH_WINDOW_DIR is set (common.EngineSettings). When active,
`register()` (run by vLLM in each of its processes) wraps these things, nothing else:
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
and, for the paths where the router's capture slot is not where the choice is seen:
- a monolithic kernel (it routes inside itself; vLLM's oracle picks one for FP8-block on Blackwell,
  bf16 on non-Hopper CUDA, NVFP4, MXFP4): `RoutedExperts.forward_monolithic` binds, at the layer's
  first forward, a RoutedExpertsSink as vLLM's routed-experts capture does (shared with it), which
  the kernel fills with the ids it routed to; a kernel that cannot report them leaves its layer out
  of the window, named under extra `uncounted_layers`, with one warning.
- a zero-expert router (LongCat): counted from its own routing with the weights, so the zero
  experts it hands on as expert 0 with weight 0 are discarded, not added to expert 0. Ids outside
  [0, E) on any path (padding rows masked to -1, fused shared experts E..E+s) go to the window's
  extra `discarded_pairs`, never to an index out of range (PairCounter).
- a drafter (MTP, EAGLE: layers vLLM builds under a model tag of its own): its layers have their own
  recorder and windows, model `<model> (draft)`, each proposal a step, each of its forwards armed
  for its real tokens (`SpecDecodeBaseProposer.propose`, `_determine_batch_execution_and_padding`);
  with EPLB each recorder's slot counts go with its own model state's map (`_eplb_map_of`).
- without EPLB the window states vLLM's expert placement (round_robin is not contiguous); with E
  not divisible by the EP size it describes the group as one rank, the real layout under extra
  `expert_placement` (`_describe_placement`).

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

import numpy as np

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
    vllm_eplb.record_engine_policy()  # moewatch's policy off: vLLM's own rebalances recorded, answers unchanged
    _state["registered"] = True
    _state["settings"] = settings
    try:
        _wrap_runner_constructor()
        _wrap_monolithic()
        _wrap_drafter()
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
    for name in ("recorder", "drafter_recorder"):
        rec = _state.get(name)
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
    rec.extra_fields.update(_rebalancing_extra(vcfg.parallel_config))  # vLLM's EPLB settings, for the agent's watch
    _state["recorder"] = rec
    _state["time_layers"] = on_cpu and eager
    return rec


def _rebalancing_extra(parallel_config) -> dict:
    """{"rebalancing": its window extra} when vLLM's EPLB is on (moewatch.integrations.vllm.rebalancing),
    else {}. Every rebalance is observed: moewatch's policy answers it, or vLLM's own is wrapped to record
    it (vllm_eplb.record_engine_policy), a record per call."""
    from moewatch.integrations.vllm.rebalancing import rebalancing_settings

    from . import vllm_eplb

    try:
        settings = rebalancing_settings(parallel_config, observed=vllm_eplb.observed())
    except (AttributeError, TypeError, ValueError) as exc:  # another vLLM's config: say so, never break serving
        logger.warning("moewatch: vLLM's EPLB settings unreadable (%s); the agent cannot watch its rebalancing", exc)
        return {}
    if settings is None:
        return {}
    extra = settings.to_extra()["rebalancing"]
    return {"rebalancing": lambda: extra}


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
    if _drafting_model():  # a drafter's layer (MTP, EAGLE): counted apart from the target's
        rec = _drafter_recorder(runner.moe_config)
        if rec is None:
            return
    else:
        rec = _recorder_for(runner.moe_config)
        if not rec.counters:
            _describe_placement(rec, runner)
    layer_id = runner.layer_id
    eplb = getattr(router, "eplb_state", None)
    num_slots = runner.moe_config.num_experts if eplb is not None else 0
    counter = rec.counter(layer_id, num_slots)
    _state.setdefault("bound", {}).setdefault(id(rec), {})[layer_id] = runner  # its model state: _eplb_map_of
    rows = None
    if _state.get("layout") is not None:  # a share of the group's tokens: count this process's own rows
        rows = vllm_layout.own_rows(_state["layout"], rec.weights, observation_off)
        _route_to(runner, router, _counting_own_rows(counter.add, rows), layer_id)
    else:
        _route_to(runner, router, counter.add, layer_id)
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
        # A zero-expert router's zero experts are mapped to expert 0's slots: discarded there too
        weights = getattr(router, "_moewatch_weights", None)
        if weights is None:
            add_slots(physical)
        else:
            add_slots(physical, weights)
        return physical

    router._apply_eplb_mapping = mapped
    if rec.slot_map is None:
        rec.slot_map = _eplb_map_of(rec)


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


# --- kernel paths, drafters and placements (what the router chose, on every path) -------------------

def _route_to(runner, router, count, layer_id: int) -> None:
    """Bind `count` where this layer's choice is seen. A zero-expert router (LongCat) hands its zero
    experts on as expert 0 with weight 0: counted from its own routing, with the weights, so those
    pairs are discarded rather than added to expert 0. Any other router: its capture slot. A layer
    whose kernel routes inside itself (a monolithic kernel never calls the router) is counted through
    the routed-experts sink vLLM's own capture binds for it (`_count_monolithic`), once the kernel is
    known (at its first forward: kernels are chosen when the weights are processed)."""
    if hasattr(router, "zero_expert_type") and hasattr(router, "_compute_routing"):
        compute = router._compute_routing

        def routing(hidden_states, router_logits, indices_type, *args, **kwargs):
            weights, ids = compute(hidden_states, router_logits, indices_type, *args, **kwargs)
            count(ids, weights)
            router._moewatch_weights = weights  # for the slot count of this forward (_count_slots)
            return weights, ids

        router._compute_routing = routing
    else:
        _share_capture_slot(router, count)
    routed = getattr(runner, "routed_experts", None)
    if routed is not None:
        routed._moewatch_count = count
        routed._moewatch_layer = layer_id


def _count_monolithic(routed_experts) -> None:
    """Bind this monolithic layer's count where vLLM's routed-experts capture binds: a
    RoutedExpertsSink on the layer, whose buffer the kernel fills with the expert ids it routed to
    and whose capture function the modular kernel then calls (FusedMoEKernelMonolithicImpl.apply).
    A sink vLLM's capture bound already is shared (its buffer, both functions); one it binds later
    replaces ours and is shared at the next forward. A kernel that cannot report its ids
    (supports_routing_replay_capture false: AITER, the Triton MXFP4 kernels, CPU int4) leaves the
    layer uncounted: it leaves the window (named under extra `uncounted_layers`), one warning per
    kernel. Runs in the first forward (the profile run, before any CUDA graph is captured); the
    buffer is allocated once, then."""
    import copy

    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExpertsMonolithic
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsSink

    count, layer_id = routed_experts._moewatch_count, routed_experts._moewatch_layer
    kernel = getattr(getattr(routed_experts.quant_method, "moe_kernel", None), "impl", None)
    fused = getattr(kernel, "fused_experts", None)
    if not (isinstance(fused, FusedMoEExpertsMonolithic) and fused.supports_routing_replay_capture()):
        routed_experts._moewatch_count = None
        name = type(fused).__name__ if fused is not None else type(routed_experts.quant_method).__name__
        _leave_uncounted(layer_id, f"monolithic kernel {name} does not report the expert ids it routes to")
        return
    other = routed_experts.routing_sink
    if other is None:
        sink = RoutedExpertsSink(fused.moe_config, count)
    else:
        theirs = other.capture_fn
        sink = copy.copy(other)  # vLLM's buffer, both capture functions

        def capture(routed_ids):
            count(routed_ids)
            theirs(routed_ids)

        sink.capture_fn = capture
    routed_experts.routing_sink = routed_experts._moewatch_sink = sink


def _leave_uncounted(layer_id: int, reason: str) -> None:
    uncounted = _state.setdefault("uncounted", {})
    for rec in (_state.get("recorder"), _state.get("drafter_recorder")):
        if rec is not None and layer_id in rec.counters:
            rec.counters.pop(layer_id)
            rec.extra_fields["uncounted_layers"] = lambda: dict(uncounted)
    if reason not in uncounted.values():
        logger.warning("moewatch: MoE layer %d is not counted: %s (its windows name it under uncounted_layers)",
                       layer_id, reason)
    uncounted[layer_id] = reason


_UNBOUND = object()  # a layer's sink before moewatch bound one (vLLM's is None or its own)


def _wrap_monolithic() -> None:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    def make(forward):
        def forward_monolithic(self, *args, **kwargs):
            if getattr(self, "_moewatch_count", None) is not None and \
                    self.routing_sink is not getattr(self, "_moewatch_sink", _UNBOUND):
                try:
                    _count_monolithic(self)
                except Exception as exc:  # never fail the forward: this layer goes uncounted
                    self._moewatch_count = None
                    _leave_uncounted(self._moewatch_layer, f"{type(exc).__name__}: {exc}")
            return forward(self, *args, **kwargs)
        return forward_monolithic

    _wrap_once(RoutedExperts, "forward_monolithic", make)


def _drafting_model() -> bool:
    """True while vLLM builds a drafter's model (an MTP, EAGLE or draft model): it builds every drafter
    under a model tag of its own (set_model_tag), the target model under the default one."""
    try:
        from vllm.compilation import backends
    except ImportError:  # a build without vLLM's compile backends: no drafter tag to read
        return False
    return getattr(backends, "model_tag", "backbone") != "backbone"


def _drafter_recorder(moe_config):
    """The recorder of the drafter's MoE layers: windows of their own, model `<model> (draft)` (vLLM's
    own name for the drafter's EPLB state), their steps the drafter's proposals (`_wrap_drafter`), their
    slot counts against the drafter's own EPLB map. None under a sharded layout (data-parallel
    attention): the drafter's layers are then not counted, with one warning."""
    rec = _state.get("drafter_recorder")
    if rec is not None:
        return rec
    main = _recorder_for(moe_config)
    if _state.get("layout") is not None:
        if not _state.get("drafter_refused"):
            _state["drafter_refused"] = True
            logger.warning("moewatch: the drafter's MoE layers are not counted under data-parallel attention "
                           "(its shards are not built); the target model's are")
        return None
    import torch

    from .common import EngineRecorder, PairWeights

    device = main.weights.tensor.device
    max_tokens = main.weights.tensor.shape[0] // main.weights.top_k
    element = torch.empty((), dtype=moe_config.in_dtype).element_size()
    rec = EngineRecorder(
        main.settings, runtime=RUNTIME_NAME, model=f"{main.model} (draft)", top_k=moe_config.experts_per_token,
        hidden_bytes=moe_config.hidden_dim * element, num_experts=moe_config.num_logical_experts,
        weights=PairWeights(max_tokens, moe_config.experts_per_token, device), world_size=main.world_size)
    rec.ranks_per_node = getattr(main, "ranks_per_node", main.world_size)
    _state["drafter_recorder"] = rec
    return rec


def _wrap_drafter() -> None:
    """The drafter's forwards run in sample_tokens, after the target's step is disarmed: a proposal
    (SpecDecodeBaseProposer.propose: MTP and EAGLE) is a step of the drafter's recorder, and each of
    its forwards is armed for its real tokens, which vLLM passes to _determine_batch_execution_and_padding
    just before it pads them. Its dummy runs (warm-up, capture) are outside a proposal: no pairs."""
    try:
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    except ImportError:  # a build without speculative decoding
        return
    _wrap_once(SpecDecodeBaseProposer, "propose", _drafting_steps)
    _wrap_once(SpecDecodeBaseProposer, "_determine_batch_execution_and_padding", _arming_draft_forwards)


def _drafting_steps(propose):
    """propose that makes a step of the drafter's recorder of each proposal with a forward."""
    def drafting(self, *args, **kwargs):
        rec = _state.get("drafter_recorder")
        if rec is None or _state.get("off"):
            return propose(self, *args, **kwargs)
        _state["drafting"], _state["draft_step_open"] = rec, False
        try:
            return propose(self, *args, **kwargs)
        finally:
            _state["drafting"] = None
            if _state.pop("draft_step_open", False):
                _recorder_call(rec.end_step)
    return drafting


def _arming_draft_forwards(determine):
    """_determine_batch_execution_and_padding that, inside a proposal, arms the drafter's pair weights
    for the real tokens of the forward it pads (the first one also begins the drafter's step)."""
    def arming(self, num_tokens, *args, **kwargs):
        rec = _state.get("drafting")
        if rec is not None:
            if not _state.get("draft_step_open"):
                _state["draft_step_open"] = _recorder_call(rec.begin_step, int(num_tokens))
            else:
                rec.weights.arm(int(num_tokens))
        return determine(self, num_tokens, *args, **kwargs)
    return arming


def _eplb_map_of(rec):
    """The slot map of `rec`'s layers: the physical_to_logical_map of the EPLB model state whose
    model holds them (vLLM registers a drafter's state first, the target's after), its rows in the
    order of the window's layers. A device tensor (the flush copies it without a host sync); None
    while no state holds them."""
    cached: dict = {}

    def slot_map():
        runner = _state.get("model_runner")
        states = getattr(getattr(runner, "eplb_state", None), "model_states", None) or {}
        if "key" not in cached or cached["key"] not in states:
            ids, bound = sorted(rec.counters), _state.get("bound", {}).get(id(rec), {})
            for key, state in states.items():
                # the state's model holds these very layers (a model lists its MoE layers, or their blocks)
                position = {}
                for i, layer in enumerate(state.model.moe_layers):
                    position[id(layer)] = position[id(getattr(layer, "experts", layer))] = i
                rows = [position.get(id(bound.get(i))) for i in ids]
                if ids and None not in rows:
                    cached.update(key=key, rows=None if rows == list(range(len(state.model.moe_layers))) else rows)
                    break
            else:
                return None
        pmap = states[cached["key"]].physical_to_logical_map
        if cached["rows"] is None:
            return pmap
        if "index" not in cached or cached["index"].device != pmap.device:
            import torch

            cached["index"] = torch.tensor(cached["rows"], dtype=torch.long, device=pmap.device)
        return pmap.index_select(0, cached["index"])

    return slot_map


def expert_placement(num_experts: int, ep_size: int, strategy: str) -> tuple[np.ndarray, list[int]]:
    """([P] logical expert of each slot, experts per rank) as vLLM places experts without EPLB:
    rank r's local experts (vLLM's determine_expert_map, linear or round_robin) in their local
    order, rank after rank. P = E; ranks hold E // W experts, the first E % W one more."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    order, per_rank = [], []
    for rank in range(ep_size):
        local, expert_map, _ = determine_expert_map(ep_size, rank, num_experts, strategy)
        held = np.full(local, -1, dtype=np.int64)
        if expert_map is None:
            held = np.arange(num_experts, dtype=np.int64)
        else:
            mapped = expert_map.numpy()
            experts = np.nonzero(mapped >= 0)[0]
            held[mapped[experts]] = experts
        order.append(held)
        per_rank.append(int(local))
    return np.concatenate(order), per_rank


def _describe_placement(rec, runner) -> None:
    """Without EPLB the experts sit where vLLM's expert map puts them: the window states that map
    (round_robin is not contiguous). When E does not divide over the EP ranks, ranks hold unequal
    numbers of experts, which a window's slot layout (P divisible by W) cannot state: the window then
    describes the group as one rank, and the real layout is under extra `expert_placement`
    (strategy, ep_size, experts per rank, the slots' experts), with one warning."""
    moe = runner.moe_config
    parallel = moe.moe_parallel_config
    if not parallel.use_ep or parallel.ep_size <= 1 or getattr(runner.router, "eplb_state", None) is not None:
        return
    strategy = str(getattr(runner, "expert_placement_strategy", "linear"))
    slots, per_rank = expert_placement(moe.num_logical_experts, parallel.ep_size, strategy)
    described = {"strategy": strategy, "ep_size": parallel.ep_size, "experts_per_rank": per_rank,
                 "slot_experts": slots.tolist()}
    rec.extra_fields["expert_placement"] = lambda: described
    if len(set(per_rank)) > 1:
        rec.world_size = rec.ranks_per_node = 1
        logger.warning("moewatch: %d experts do not divide over %d EP ranks (vLLM places %s experts per rank, "
                       "%s): windows describe the group as one rank, with the placement under "
                       "extra.expert_placement", moe.num_logical_experts, parallel.ep_size, per_rank, strategy)
    elif strategy != "linear":
        rec.placement = slots


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
