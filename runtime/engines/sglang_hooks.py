"""A hook factory for SGLang's `--forward-hooks`: pairs per layer and slot, counted on the device,
through SGLang's own expert-distribution recorder wherever it is on.

    --forward-hooks '[{"name": "moewatch", "target_modules": ["model.layers.*.mlp.topk"],
      "hook_factory": "moewatch.runtime.engines.sglang_hooks:topk_counter",
      "config": {"num_layers": 61, "num_experts": 256, "ep_size": 8, "model": "deepseek-v3"}}]'
    --expert-distribution-recorder-mode stat     (needed with CUDA graphs or two-batch overlap)

SGLang calls the factory once per model runner, in `finalize_cuda_graph_capture`
(model_executor/model_runner_components/cuda_graph_setup.py), AFTER it has captured its CUDA graphs:
a forward hook never runs when a graph replays, so on its own it counts only eager passes (prefill,
and decode with graphs off). Where graphs or two-batch overlap run, the counts come from SGLang's
expert-distribution recorder instead (eplb/expert_distribution.py): its gatherer adds each layer's
top-k ids into a device buffer inside the captured graphs, and at the end of every forward pass
(graph replay included, and both micro-batches of two-batch overlap together) hands that pass's
[L, P] physical counts to its accumulator's `append`. The factory attaches there
(`RecorderTap`): one in-place add into moewatch's counters per pass, on the model's stream, no host
sync; it starts the recorder when it is not recording and its `stat` buffer is bounded. Without the
recorder, a layout with CUDA graphs or two-batch overlap is refused with one warning naming SGLang's
version and the flag to set; so are top-k formats without expert ids (Triton-kernel, FlashInfer
TRT-LLM's and MXFP4's in-kernel routing), which neither a hook nor the recorder sees
(sglang_layout.py has every rule).

The counters [L, P + 2] are allocated once, on the model's device, and never reset: a background
thread copies them (on a side stream on a GPU) at every multiple of `window_seconds` of wall-clock
time, and the window is the difference from the previous copy. Column P counts ids outside [0, P)
(forward-hook path: padding, fused shared experts), column P + 1 the hook's layer calls.

Which processes report: where each attention-DP rank routes its own tokens (DeepEP and the other
all-to-all backends), every rank sends a shard of its EP group's window (`shard`: index = its
attention-DP rank, count = the attention-DP size, rank = its MoE EP rank, sequence = the wall-clock
bucket), which the agent merges; elsewhere every rank routes the whole batch and TP rank 0 reports.
Windows carry `runtime: "sglang"`, the map in force (SGLang's, read at flush, when its expert-location
metadata is published; else the config's `physical_to_logical_map`; else the trivial one, slot
s = expert s % E), per-slot counts and the logical counts through the map; timings and per-step batch
sizes are absent. Under DeepEP's dispatch-count gatherers the counts are what this rank's slots
received (`source.counts: "received"`). SGLang's MoE is dropless: dropped and rerouted pairs are zeros.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from moewatch import wire
from moewatch.telemetry import Window, WindowError

from . import sglang_eplb, sglang_layout, sglang_routed
from .common import Sink, env_sinks, logical_window

log = logging.getLogger("moewatch.runtime.engines.sglang")

RUNTIME = "sglang"


class HookConfigError(ValueError):
    """A bad `config` entry in the --forward-hooks spec; the message names the key."""


@dataclass(frozen=True)
class HookConfig:
    num_layers: int
    num_experts: int
    num_slots: int = 0  # 0: num_experts
    ep_size: int = 1
    top_k: int = 1
    model: str = "sglang"
    ep_group: str = "ep0"
    window_seconds: float = 10.0
    per_rank: bool = False
    hidden_bytes: int = 0
    physical_to_logical_map: tuple = field(default=())

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> "HookConfig":
        if not isinstance(raw, Mapping):
            raise HookConfigError(f"config: expected an object, got {type(raw).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise HookConfigError(f"config.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")
        for key in ("num_layers", "num_experts"):
            if key not in raw:
                raise HookConfigError(f"config.{key}: required")
        values = dict(raw)
        for key in ("num_layers", "num_experts", "num_slots", "ep_size", "top_k", "hidden_bytes"):
            if key in values and (isinstance(values[key], bool) or not isinstance(values[key], int)
                                  or values[key] < (0 if key in ("num_slots", "hidden_bytes") else 1)):
                raise HookConfigError(f"config.{key}: expected a positive integer, got {values[key]!r}")
        if "window_seconds" in values:
            w = values["window_seconds"]
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.01 <= w <= 86_400:
                raise HookConfigError(f"config.window_seconds: expected seconds in [0.01, 86400], got {w!r}")
        for key in ("model", "ep_group"):
            if key in values and not isinstance(values[key], str):
                raise HookConfigError(f"config.{key}: expected a string")
        if "physical_to_logical_map" in values:
            values["physical_to_logical_map"] = tuple(map(tuple, values["physical_to_logical_map"]))
        cfg = cls(**values)
        P = cfg.slots
        if P < cfg.num_experts or P % cfg.ep_size:
            raise HookConfigError(f"config.num_slots: {P} slots must hold {cfg.num_experts} experts and divide over "
                                  f"ep_size {cfg.ep_size}")
        if cfg.physical_to_logical_map:
            pmap = np.asarray(cfg.physical_to_logical_map)
            if pmap.shape != (cfg.num_layers, P):
                raise HookConfigError(f"config.physical_to_logical_map: shape {list(pmap.shape)}, expected "
                                      f"[{cfg.num_layers}, {P}]")
        return cfg

    @property
    def slots(self) -> int:
        return self.num_slots or self.num_experts


class TopKCounter:
    """The hook: `(module, inputs, output) -> None`, output untouched. With a recorder attached
    (`attach_recorder`) the recorder counts and the hook only watches for outputs without ids."""

    def __init__(self, cfg: HookConfig, sinks: list[Sink], *, device: torch.device | str | None = None,
                 rank: int = 0, closers: tuple = (), start_thread: bool = True, shard: Mapping | None = None,
                 ranks_per_node: int | None = None, counts_received: bool = False, counts_padding: bool = False):
        self.cfg = cfg
        self.sinks = list(sinks)
        self._closers = list(closers)
        self.rank = rank
        self.ep_group = cfg.ep_group
        self.shard = dict(shard) if shard is not None else None
        self.ranks_per_node = ranks_per_node or cfg.ep_size
        self.counts_received = counts_received
        self.counts_padding = counts_padding
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        P = cfg.slots
        self.counts = torch.zeros(cfg.num_layers, P + 2, dtype=torch.int64, device=self.device)
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._last = np.zeros((cfg.num_layers, P + 2), dtype=np.int64)
        self._last_time = time.time()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.recorder: Any = None  # SGLang's recorder when it counts (RecorderTap)
        self._pass_numbers = itertools.count(1)
        self._passes = 0  # forward passes the recorder handed over (host side: no sync)
        self._last_passes = 0
        self._active = False  # the previous window had passes (a shard is then sent even when empty)
        self._idless_layers: set = set()
        self._warned: set[str] = set()
        self.windows_built = 0
        self._lost: dict[str, int] = {}  # windows lost by reason (wire.WINDOW_LOSS_REASONS)
        self._thread = None
        if start_thread:
            self._thread = threading.Thread(target=self._run, name="moewatch-sglang-flush", daemon=True)
            self._thread.start()
            atexit.register(self.close)

    # --- in the forward pass -------------------------------------------------------------------
    def __call__(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        ids = getattr(output, "topk_ids", None)
        layer = getattr(module, "layer_id", None)
        if ids is None:
            if layer not in self._idless_layers:
                self._idless_layers.add(layer)
                self._warn_once("idless", "moewatch: SGLang's top-k output %s carries no expert ids: layer %s and any "
                                "like it are not counted (windows list them under source.layers_without_ids)",
                                type(output).__name__, layer)
            return None
        if self.recorder is not None or layer is None or not 0 <= layer < self.cfg.num_layers:
            return None  # the recorder counts; or a module outside the map (a drafter's layer)
        P = self.cfg.slots
        flat = ids.reshape(-1)
        index = torch.where((flat >= 0) & (flat < P), flat, P).long()
        row = self.counts[layer]
        row.scatter_add_(0, index, torch.ones_like(index))
        row[P + 1:].add_(1)
        return None

    def attach_recorder(self, recorder: Any, *, start_recording: bool = False) -> None:
        """Count every pass SGLang's expert-distribution recorder accumulates (RecorderTap)."""
        RecorderTap(recorder, self.on_pass)
        self.recorder = recorder
        if start_recording and not recorder.recording:
            recorder.start_record()
            log.info("moewatch: started SGLang's expert-distribution recorder to count through it")

    def on_pass(self, global_physical_count: torch.Tensor) -> None:
        """One forward pass's [L, P] physical counts, from the recorder (engine thread, model stream)."""
        self.counts[:, :self.cfg.slots].add_(global_physical_count)
        self._passes = next(self._pass_numbers)  # no lock: the flush may hold it while it copies

    # --- off the forward pass ------------------------------------------------------------------
    def _snapshot(self) -> np.ndarray:
        if self._side is not None:
            # A copy on a side stream: it does not wait for the model's stream, and the counters only
            # grow, so a copy taken mid-step is a consistent enough cut for a window.
            with torch.cuda.stream(self._side):
                host = self.counts.to("cpu")
            return host.numpy().copy()
        return self.counts.cpu().numpy().copy()

    def current_map(self) -> np.ndarray:
        """[L, P] the map in force: SGLang's published one, else the config's, else the trivial one."""
        try:
            from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

            meta = get_global_expert_location_metadata()
        except Exception:  # SGLang absent (tests) or its metadata not published
            meta = None
        if meta is not None and tuple(meta.physical_to_logical_map_cpu.shape) == (self.cfg.num_layers, self.cfg.slots):
            return meta.physical_to_logical_map_cpu.numpy().astype(np.int64)
        if self.cfg.physical_to_logical_map:
            return np.asarray(self.cfg.physical_to_logical_map, dtype=np.int64)
        return np.tile(np.arange(self.cfg.slots, dtype=np.int64) % self.cfg.num_experts, (self.cfg.num_layers, 1))

    def flush(self, sequence: int | None = None) -> Window | None:
        """The window since the previous flush, handed to the sinks; None when no pass happened (a
        shard whose previous window had passes is still sent, empty, so the agent need not wait for
        it). `sequence`: the wall-clock bucket it closes (default: the bucket of now)."""
        self._follow_recorder()
        with self._lock:
            now_counts, now, passes = self._snapshot(), time.time(), self._passes
            delta, start = now_counts - self._last, self._last_time
            steps_from_recorder = passes - self._last_passes
            self._last, self._last_time, self._last_passes = now_counts, now, passes
        cfg, P = self.cfg, self.cfg.slots
        steps = steps_from_recorder if self.recorder is not None else int(delta[:, P + 1].max())
        if steps == 0 and not (self.shard is not None and self._active):
            self._active = False
            return None
        self._active = steps > 0
        slots = delta[:, :P]
        extra: dict[str, Any] = {"source": self._source(delta), **sglang_eplb.window_extra()}
        if self.shard is not None:
            bucket = sglang_layout.window_sequence(now, cfg.window_seconds) if sequence is None else sequence
            extra["shard"] = {**self.shard, "sequence": bucket}
        try:
            pmap = self.current_map()
            if pmap.shape != (cfg.num_layers, P) or pmap.min() < 0 or pmap.max() >= cfg.num_experts:
                raise WindowError("physical_to_logical_map", f"the map in force, shape {list(pmap.shape)}, names "
                                  f"experts outside [0, {cfg.num_experts}) or is not [{cfg.num_layers}, {P}]")
            expert = np.zeros((cfg.num_layers, cfg.num_experts), dtype=np.int64)
            np.add.at(expert, (np.arange(cfg.num_layers)[:, None], pmap), slots)
            window = logical_window(
                runtime=RUNTIME, model=cfg.model, ep_group=self.ep_group, top_k=min(cfg.top_k, cfg.num_experts),
                hidden_bytes=cfg.hidden_bytes, expert_tokens=expert, steps=steps, start_time=start, end_time=now,
                world_size=cfg.ep_size, slot_tokens=slots, physical_to_logical_map=pmap, extra=extra)
            if self.ranks_per_node != window.ranks_per_node:
                window = window.replace(ranks_per_node=self.ranks_per_node)
        except WindowError as exc:  # never break serving over a window: counted, logged once
            self._count_lost("invalid", exc)
            return None
        self.windows_built += 1
        for sink in self.sinks:
            try:
                sink(window)
            except Exception as exc:  # a full disk must not stop the engine
                self._count_lost("sink_error", exc)
        return window

    def _count_lost(self, reason: str, exc: BaseException) -> None:
        self._lost[reason] = self._lost.get(reason, 0) + 1
        self._warn_once(f"lost:{reason}", "moewatch: a window was lost (%s: %s: %s); windows lost for this reason "
                        "are counted (moewatch_runtime_windows_lost_total) and not logged again",
                        reason, type(exc).__name__, exc)

    def windows_lost(self) -> dict[str, int]:
        """Windows lost so far in this process, by reason: the counter's own and its sender's."""
        out = dict(self._lost)
        for sender in self._senders():
            for reason, count in dict(sender.stats.window_drops).items():
                out[reason] = out.get(reason, 0) + count
        return {reason: count for reason, count in out.items() if count}

    def heartbeat(self) -> wire.Heartbeat:
        """What the socket's sender reports every second: passes so far and the windows lost."""
        return wire.Heartbeat(time=time.time(), epoch=0, step=self._passes,
                              frames_dropped=sum(sender.stats.frames_dropped for sender in self._senders()),
                              extra={"windows_lost": self.windows_lost()})

    def _senders(self) -> list:
        return [sink.sender for sink in self.sinks if getattr(sink, "sender", None) is not None]

    def _source(self, delta: np.ndarray) -> dict[str, Any]:
        if self.recorder is None:
            source: dict[str, Any] = {"kind": "sglang-forward-hook",
                                      "ids_outside_slots": int(delta[:, self.cfg.slots].sum())}
        else:
            source = {"kind": "sglang-expert-distribution-recorder",
                      "counts": "received" if self.counts_received else "routed"}
        if self.counts_padding:
            source["padded_rows"] = "counted"
        if self._idless_layers:
            source["layers_without_ids"] = sorted(self._idless_layers, key=str)
        return source

    def _follow_recorder(self) -> None:
        """SGLang builds a new recorder after an elastic-EP change: count through the new one."""
        if self.recorder is None:
            return
        from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder

        current = get_global_expert_distribution_recorder()
        if current is not self.recorder and hasattr(current, "_accumulator"):
            log.info("moewatch: SGLang replaced its expert-distribution recorder; counting through the new one")
            self.attach_recorder(current, start_recording=False)
        if not self.recorder.recording:
            self._warn_once("stopped", "moewatch: SGLang's expert-distribution recorder is not recording: windows "
                            "pause until it records again")

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def _run(self) -> None:
        # Windows end at multiples of window_seconds of wall-clock time, the same instants on every
        # rank, so each window's bucket is the shared sequence of the group's shards.
        seconds = self.cfg.window_seconds
        while True:
            now = time.time()
            boundary = (math.floor(now / seconds) + 1) * seconds
            if self._stop.wait(max(boundary - now, 0.0)):
                return
            try:
                self.flush(sequence=round(boundary / seconds) - 1)
            except Exception as exc:  # the timer goes on: the next window counts from the last read
                self._count_lost("timer_error", exc)

    def close(self) -> None:
        global _process_counter
        if self._stop.is_set():
            return
        self._stop.set()
        self.flush()
        for close in self._closers:
            close()
        if _process_counter is self:
            _process_counter = None

    def hello(self) -> wire.Hello:
        return _hello(self.cfg, self.ep_group, self.ranks_per_node, self.shard)


class RecorderTap:
    """Attaches to SGLang's expert-distribution recorder: after its accumulator's own `append` of a
    forward pass (model_runner.forward ends every pass, replayed graphs included, with
    `_on_forward_pass_end`, which hands the primary gatherer's [L, P] `global_physical_count` to
    `append`), the same device tensor goes to `on_pass`. A speculative drafter's pass (its model
    runner shares the process's recorder) is left out: SGLang records none of its pairs, and it is
    not a step of the model. An error is logged once and the tap stays out of SGLang's way after."""

    def __init__(self, recorder: Any, on_pass: Any):
        from sglang.srt.eplb.expert_distribution import _SINGLE_PASS_GATHERER_KEY_PRIMARY as primary

        accumulator = recorder._accumulator
        original = getattr(accumulator, "_moewatch_original_append", accumulator.append)
        original_start = getattr(recorder, "_moewatch_original_start", recorder._on_forward_pass_start)
        state = {"broken": False, "drafter": False}

        def on_forward_pass_start(forward_batch):
            state["drafter"] = is_drafter_pass(forward_batch)
            return original_start(forward_batch)

        def append(forward_pass_id, gatherer_key, single_pass_data, outputs):
            result = original(forward_pass_id, gatherer_key, single_pass_data, outputs)
            if gatherer_key == primary and not state["broken"] and not state["drafter"]:
                try:
                    routed = single_pass_data.get(sglang_routed.ROUTED_KEY)  # DeepEP: what this rank routed
                    on_pass(single_pass_data["global_physical_count"] if routed is None else routed)
                except Exception as exc:  # never into SGLang's forward pass
                    state["broken"] = True
                    log.warning("moewatch: counting through SGLang's recorder failed, counting stops: %s", exc)
            return result

        accumulator._moewatch_original_append = original
        accumulator.append = append
        recorder._moewatch_original_start = original_start
        recorder._on_forward_pass_start = on_forward_pass_start


def is_drafter_pass(forward_batch: Any) -> bool:
    """Whether a forward batch is a speculative drafter's (its spec_info a draft input, or a
    draft-extend pass); the target's verify pass is the model's step."""
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is not None and getattr(mode, "is_draft_extend_v2", lambda: False)():
        return True
    spec = getattr(forward_batch, "spec_info", None)
    return bool(spec is not None and getattr(spec, "is_draft_input", lambda: False)())


def _hello(cfg: HookConfig, ep_group: str, ranks_per_node: int | None = None,
           shard: Mapping | None = None) -> wire.Hello:
    """The connection's hello; a shard's names which shard it is, so the agent keeps one connection each."""
    sharding = {"shard_index": shard["index"], "shard_count": shard["count"]} if shard else {}
    return wire.Hello(runtime=RUNTIME, model=cfg.model, ep_group=ep_group, world_size=cfg.ep_size,
                      num_layers=cfg.num_layers, num_experts=cfg.num_experts, num_slots=cfg.slots,
                      ranks_per_node=ranks_per_node or cfg.ep_size, pid=os.getpid(), **sharding)


# One counter per process: SGLang calls the factory again for a speculative drafter's model runner,
# whose passes the same recorder (and the same counter) already sees.
_process_counter: TopKCounter | None = None


def topk_counter(config: Mapping[str, Any] | None) -> TopKCounter | None:
    """The factory named in --forward-hooks. None (SGLang then registers nothing) when neither
    MOEWATCH_SOCKET nor MOEWATCH_WINDOW_DIR is set, on a rank that does not report, or when the
    layout is refused (one warning naming SGLang's version and the reason)."""
    global _process_counter
    cfg = HookConfig.from_mapping(config or {})
    if _process_counter is not None and _process_counter.cfg == cfg:
        return _process_counter
    try:
        layout = sglang_layout.read_layout()
        from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder

        recorder = get_global_expert_distribution_recorder() if layout.recorder_mode is not None else None
        meta = getattr(recorder, "_expert_location_metadata", None)
        decision = sglang_layout.decide(
            layout, num_layers=cfg.num_layers, num_slots=cfg.slots, ep_size=cfg.ep_size,
            recorder_layers=getattr(meta, "num_layers", None), recorder_slots=getattr(meta, "num_physical_experts", None))
    except Exception as exc:  # an SGLang this hook does not know: serve on, unobserved
        log.warning("moewatch: observation off: SGLang's layout could not be read (%s: %s)", type(exc).__name__, exc)
        return None
    if decision.refusal is not None:
        log.warning("moewatch: observation off on SGLang %s: %s", layout.version, decision.refusal)
        return None
    if cfg.per_rank:
        log.warning("moewatch: config.per_rank is no longer used: ranks that route a share of the group's tokens "
                    "send shards of one window")
    if not decision.reports:
        return None
    rank = layout.moe_ep_rank if decision.shard is not None else max(layout.tp_rank, 0)
    made: list[TopKCounter] = []
    sinks, closers = env_sinks(lambda: _hello(cfg, cfg.ep_group, decision.ranks_per_node, decision.shard),
                               heartbeat=lambda: made[0].heartbeat())
    if not sinks:
        return None
    counter = TopKCounter(cfg, sinks, rank=rank, closers=tuple(closers), shard=decision.shard,
                          ranks_per_node=decision.ranks_per_node, counts_received=decision.counts_received,
                          counts_padding=decision.counts_padding)
    if decision.counts_padding:
        log.warning("moewatch: SGLang %s routes the padded rows of the batch it gathers over attention-DP ranks "
                    "and masks none: their pairs are counted (windows say source.padded_rows: counted)",
                    layout.version)
    made.append(counter)
    if decision.use_recorder:
        counter.attach_recorder(recorder, start_recording=decision.start_recording)
    _process_counter = counter
    return counter
