"""A hook factory for SGLang's `--forward-hooks`: pairs per layer and slot, counted on the device.

SGLang registers each factory's hook once, when the model runner starts, on every module whose name
matches the spec's fnmatch patterns (python/sglang/srt/model_executor/hook_manager.py). Target the
MoE layers' top-k modules; their output carries `topk_ids` [N, k] (StandardTopKOutput and its kin in
python/sglang/srt/layers/moe/topk.py), physical slot ids when SGLang remaps experts (EPLB, redundant
experts), logical ids otherwise; padded tokens hold -1.

    --forward-hooks '[{"name": "moewatch", "target_modules": ["model.layers.*.mlp.topk"],
      "hook_factory": "moewatch.runtime.engines.sglang_hooks:topk_counter",
      "config": {"num_layers": 61, "num_experts": 256, "ep_size": 8, "model": "deepseek-v3"}}]'

Graph-safe: the counters [L, P + 2] are allocated once, in the factory, on the model's device; a hook
call only adds into them (scatter_add_ and add_ on views: no allocation of state, no host sync, no
Python-side state that CUDA graph replay would skip). Counters are never reset on the device: a
background thread copies them every `window_seconds` (on a side stream on a GPU) and the window is
the difference from the previous copy. Column P counts ids outside [0, P) (padding, fused shared
experts), column P + 1 the layer's forward passes (the window's steps).

Reported once per EP group: only the group's first rank (global rank % ep_size == 0) builds a hook;
with attention data parallelism each rank routes its own tokens, so set `"per_rank": true` to have
every rank report its own share as group `<ep_group>-rank<r>`. Windows carry `runtime: "sglang"`,
the map in force (SGLang's, read at flush, when its expert-location metadata is published; else the
config's `physical_to_logical_map`; else the trivial one, slot s = expert s % E), per-slot counts and
the logical counts through the map; timings and per-step batch sizes are absent. SGLang's MoE is
dropless: dropped and rerouted pairs are zeros.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from moewatch import wire
from moewatch.telemetry import Window, WindowError

from . import sglang_eplb
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
    """The hook: `(module, inputs, output) -> None`, output untouched."""

    def __init__(self, cfg: HookConfig, sinks: list[Sink], *, device: torch.device | str | None = None,
                 rank: int = 0, closers: tuple = (), start_thread: bool = True):
        self.cfg = cfg
        self.sinks = list(sinks)
        self._closers = list(closers)
        self.rank = rank
        self.ep_group = f"{cfg.ep_group}-rank{rank}" if cfg.per_rank else cfg.ep_group
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
        self.windows_built = 0
        self.windows_invalid = 0
        self._thread = None
        if start_thread:
            self._thread = threading.Thread(target=self._run, name="moewatch-sglang-flush", daemon=True)
            self._thread.start()
            atexit.register(self.close)

    # --- in the forward pass -------------------------------------------------------------------
    def __call__(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        ids = getattr(output, "topk_ids", None)
        layer = getattr(module, "layer_id", None)
        if ids is None or layer is None or not 0 <= layer < self.cfg.num_layers:
            return None  # a top-k format without ids (bypassed, Triton kernel) or a module outside the map
        P = self.cfg.slots
        flat = ids.reshape(-1)
        index = torch.where((flat >= 0) & (flat < P), flat, P).long()
        row = self.counts[layer]
        row.scatter_add_(0, index, torch.ones_like(index))
        row[P + 1:].add_(1)
        return None

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

    def flush(self) -> Window | None:
        """The window since the previous flush, handed to the sinks; None when no pass happened."""
        with self._lock:
            now_counts, now = self._snapshot(), time.time()
            delta, start = now_counts - self._last, self._last_time
            self._last, self._last_time = now_counts, now
        cfg, P = self.cfg, self.cfg.slots
        steps = int(delta[:, P + 1].max())
        if steps == 0:
            return None
        slots = delta[:, :P]
        pmap = self.current_map()
        expert = np.zeros((cfg.num_layers, cfg.num_experts), dtype=np.int64)
        np.add.at(expert, (np.arange(cfg.num_layers)[:, None], pmap), slots)
        try:
            window = logical_window(
                runtime=RUNTIME, model=cfg.model, ep_group=self.ep_group, top_k=min(cfg.top_k, cfg.num_experts),
                hidden_bytes=cfg.hidden_bytes, expert_tokens=expert, steps=steps, start_time=start, end_time=now,
                world_size=cfg.ep_size, slot_tokens=slots, physical_to_logical_map=pmap,
                extra={"source": {"kind": "sglang-forward-hook", "ids_outside_slots": int(delta[:, P].sum())},
                       **sglang_eplb.window_extra()})
        except WindowError as exc:  # never break serving over a window
            self.windows_invalid += 1
            log.warning("moewatch: window not built: %s", exc)
            return None
        self.windows_built += 1
        for sink in self.sinks:
            try:
                sink(window)
            except Exception as exc:  # a full disk must not stop the engine
                log.warning("moewatch: sink failed: %s", exc)
        return window

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.window_seconds):
            self.flush()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self.flush()
        for close in self._closers:
            close()

    def hello(self) -> wire.Hello:
        return _hello(self.cfg, self.ep_group)


def _hello(cfg: HookConfig, ep_group: str) -> wire.Hello:
    return wire.Hello(runtime=RUNTIME, model=cfg.model, ep_group=ep_group, world_size=cfg.ep_size,
                      num_layers=cfg.num_layers, num_experts=cfg.num_experts, num_slots=cfg.slots,
                      ranks_per_node=cfg.ep_size, pid=os.getpid())


def topk_counter(config: Mapping[str, Any] | None) -> TopKCounter | None:
    """The factory named in --forward-hooks. None (SGLang then registers nothing) when neither
    MOEWATCH_SOCKET nor MOEWATCH_WINDOW_DIR is set, or on a rank that does not report."""
    cfg = HookConfig.from_mapping(config or {})
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if not cfg.per_rank and rank % cfg.ep_size != 0:
        return None
    ep_group = f"{cfg.ep_group}-rank{rank}" if cfg.per_rank else cfg.ep_group
    sinks, closers = env_sinks(lambda: _hello(cfg, ep_group))
    if not sinks:
        return None
    return TopKCounter(cfg, sinks, rank=rank, closers=tuple(closers))
