"""What every engine adapter shares: its settings from the environment, graph-safe pair counters,
the window it builds from logical counts, and the sinks it hands windows to.

An adapter (vllm_plugin.py, transformers_probe.py) sees only what the engine's router chose: logical
top-k expert ids per token. From those it counts pairs per layer and logical expert on the device
(`PairCounter`), and at flush builds a Window (`logical_window`) that carries what it measured and
leaves out, as absent evidence (docs/telemetry.md), what it did not: rank-level counts when no slot counts
were seen, timings when they could not be had without a host sync. Nothing is guessed. The SGLang
hook (sglang_hooks.py) ends its windows on its own timer from cumulative counters, and builds them
with the same `logical_window`.

Sizes: L MoE layers, E logical experts, P slots, k experts per token, N tokens in a step.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from moewatch import wire
from moewatch.telemetry import Window

from ..sender import Sender
from .clock import EventClock

ENV_SOCKET = "MOEWATCH_SOCKET"
ENV_WINDOW_DIR = "MOEWATCH_WINDOW_DIR"
ENV_WINDOW_STEPS = "MOEWATCH_WINDOW_STEPS"
ENV_WINDOW_SECONDS = "MOEWATCH_WINDOW_SECONDS"
ENV_MODEL = "MOEWATCH_MODEL"
ENV_EP_GROUP = "MOEWATCH_EP_GROUP"
DEFAULT_WINDOW_STEPS = 50


@dataclass(frozen=True)
class EngineSettings:
    """Where windows go and how long one lasts. `window_steps` and `window_seconds`: whichever
    comes first ends a window; at least one is set."""

    socket: str | None = None
    window_dir: str | None = None
    window_steps: int | None = DEFAULT_WINDOW_STEPS
    window_seconds: float | None = None
    model: str | None = None
    ep_group: str = "ep0"

    def __post_init__(self) -> None:
        if self.window_steps is None and self.window_seconds is None:
            raise ValueError(f"{ENV_WINDOW_STEPS}: give a window length in steps or {ENV_WINDOW_SECONDS}")
        if self.window_steps is not None and self.window_steps < 1:
            raise ValueError(f"{ENV_WINDOW_STEPS}: must be a positive integer, got {self.window_steps}")
        if self.window_seconds is not None and not self.window_seconds > 0:
            raise ValueError(f"{ENV_WINDOW_SECONDS}: must be a positive number, got {self.window_seconds}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "EngineSettings | None":
        """The settings, or None when neither MOEWATCH_SOCKET nor MOEWATCH_WINDOW_DIR is set (the
        adapter then stays inactive). A malformed value raises ValueError naming the variable."""
        env = os.environ if environ is None else environ
        socket_path = env.get(ENV_SOCKET) or None
        window_dir = env.get(ENV_WINDOW_DIR) or None
        if socket_path is None and window_dir is None:
            return None
        steps_text, seconds_text = env.get(ENV_WINDOW_STEPS), env.get(ENV_WINDOW_SECONDS)
        steps: int | None = DEFAULT_WINDOW_STEPS if not steps_text and not seconds_text else None
        seconds: float | None = None
        if steps_text:
            try:
                steps = int(steps_text)
            except ValueError:
                raise ValueError(f"{ENV_WINDOW_STEPS}: expected an integer, got {steps_text!r}") from None
        if seconds_text:
            try:
                seconds = float(seconds_text)
            except ValueError:
                raise ValueError(f"{ENV_WINDOW_SECONDS}: expected a number, got {seconds_text!r}") from None
        return cls(socket=socket_path, window_dir=window_dir, window_steps=steps, window_seconds=seconds,
                   model=env.get(ENV_MODEL) or None, ep_group=env.get(ENV_EP_GROUP) or "ep0")


class PairCounter:
    """One MoE layer's pair counts, kept on the device in tensors allocated once.

    `add(topk_ids)` is graph-safe: two in-place index_add_ into preallocated buffers, no host sync,
    no allocation (slices are views), so it survives torch.compile and CUDA graph capture. Each pair
    is weighted by the `weights` buffer (token-major, [max_tokens * k]), which the adapter sets on the
    host between steps: ones over the real tokens of a real step, zeros otherwise, so warm-up,
    profiling, dummy runs and padded tokens add nothing."""

    def __init__(self, num_experts: int, weights: "PairWeights | torch.Tensor", num_slots: int = 0):
        if isinstance(weights, PairWeights):
            self.weights, self.top_k, self._scratch = weights.tensor, weights.top_k, weights.scratch
            self._zero_weight = weights.zero_weight
        else:  # a bare weight buffer: ids are taken as they come, with scratch of its own
            self.weights, self.top_k = weights, None
            self._scratch = torch.empty(2 * weights.shape[0], dtype=torch.int64, device=weights.device)
            self._zero_weight = torch.empty(weights.shape[0], dtype=torch.bool, device=weights.device)
        device = self.weights.device
        # One bin past the last expert (slot): a pair whose id is outside [0, E) lands there, never
        # as an index out of range (a device-side assert on CUDA would end the engine).
        self._expert_bins = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
        self.counts, self.discarded = self._expert_bins[:num_experts], self._expert_bins[num_experts:]
        self._slot_bins = torch.zeros(num_slots + 1, dtype=torch.int64, device=device) if num_slots else None
        self.slot_counts = self._slot_bins[:num_slots] if num_slots else None
        self.slot_discarded = self._slot_bins[num_slots:] if num_slots else None

    def add(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None) -> None:
        """Count the router's choice [N, c]. Ids outside [0, E) (padding rows masked to -1) go to
        `discarded`; so do columns past top_k, which a router appends after its choice (fused shared
        experts, ids E..E+s) and, given `topk_weights`, pairs of weight exactly 0 (a zero-expert
        router hands its zero experts on as expert 0 with weight 0)."""
        self._tally(self._expert_bins, topk_ids, topk_weights)

    def add_slots(self, physical_ids: torch.Tensor) -> None:
        self._tally(self._slot_bins, physical_ids, None)

    def _tally(self, bins: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor | None) -> None:
        # In-place on preallocated scratch: the ids are copied (never changed: the engine uses them),
        # clamped to [-1, outside] and taken mod outside + 1, which sends -1 and >= outside to the
        # outside bin and keeps [0, outside) as is. No host sync, no allocation.
        outside = bins.shape[0] - 1
        extra = 0
        if ids.dim() == 2 and self.top_k is not None and ids.shape[1] > self.top_k:
            extra, ids = ids.shape[1] - self.top_k, ids[:, :self.top_k]
        n = ids.numel()
        index = self._scratch[:n].view(ids.shape)
        index.copy_(ids)
        index.clamp_(-1, outside).remainder_(outside + 1)
        if topk_weights is not None:
            zero = self._zero_weight[:n].view(ids.shape)
            torch.eq(topk_weights[..., :ids.shape[-1]], 0, out=zero)
            index.masked_fill_(zero, outside)
        bins.index_add_(0, index.view(-1), self.weights[:n])
        if extra:  # each real token's appended columns: `extra` pairs outside, per token's weight
            tokens = ids.shape[0]
            rest = self._scratch[n:n + tokens].fill_(outside)
            bins.index_add_(0, rest, self.weights.view(-1, self.top_k)[:tokens, 0], alpha=extra)

    def take(self) -> tuple[np.ndarray, np.ndarray | None]:
        """([E], [P] or None) counts since the last take, zeroed after (the one host read: at flush)."""
        counts = self.counts.cpu().numpy().copy()
        self.counts.zero_()
        slots = None
        if self.slot_counts is not None:
            slots = self.slot_counts.cpu().numpy().copy()
            self.slot_counts.zero_()
        return counts, slots


class PairWeights:
    """The shared token-major weight buffer of a process's counters (see PairCounter)."""

    def __init__(self, max_tokens: int, top_k: int, device: torch.device | str):
        self.top_k = top_k
        self.tensor = torch.zeros(max_tokens * top_k, dtype=torch.int64, device=device)
        # The counters' scratch (PairCounter._tally): their kernels run one after another on the
        # engine's stream (micro-batches too share one compute stream), so one copy serves them all.
        self.scratch = torch.empty(max_tokens * (top_k + 1), dtype=torch.int64, device=device)
        self.zero_weight = torch.empty(max_tokens * top_k, dtype=torch.bool, device=device)
        self._armed = 0

    def arm(self, num_tokens: int) -> None:
        """Count the first `num_tokens` tokens of the coming forward (host-side, between steps)."""
        pairs = min(num_tokens * self.top_k, self.tensor.shape[0])
        if pairs > self._armed:
            self.tensor[self._armed:pairs].fill_(1)
        elif pairs < self._armed:
            self.tensor[pairs:self._armed].zero_()
        self._armed = pairs

    def disarm(self) -> None:
        self.arm(0)


def logical_window(*, runtime: str, model: str, ep_group: str, top_k: int, hidden_bytes: int,
                   expert_tokens: np.ndarray, steps: int, start_time: float, end_time: float,
                   world_size: int = 1, slot_tokens: np.ndarray | None = None,
                   physical_to_logical_map: np.ndarray | None = None, layer_seconds: np.ndarray | None = None,
                   step_seconds: Sequence[float] | None = None, step_tokens: Sequence[int] | None = None,
                   extra: Mapping | None = None) -> Window:
    """A Window from what an engine adapter measured. expert_tokens [L, E] always; slot_tokens [L, P]
    with the map [L, P] in force when the engine has redundant slots (else P = E, identity map, and
    rank-level counts are absent); layer_seconds [L, W] only when timed without a sync; per-step
    data only when measured. Engines here drop no pairs and have no capacity factor: zeros."""
    counts = np.asarray(expert_tokens, dtype=np.int64)
    L, E = counts.shape
    if physical_to_logical_map is None:
        pmap = np.tile(np.arange(E, dtype=np.int64), (L, 1))
    else:
        pmap = np.asarray(physical_to_logical_map, dtype=np.int64)
    P = pmap.shape[1]
    fields = dict(
        runtime=runtime, model=model, ep_group=ep_group, world_size=world_size, ranks_per_node=world_size,
        num_layers=L, num_experts=E, num_slots=P, top_k=top_k, epoch=0, steps=steps,
        start_time=start_time, end_time=max(end_time, start_time), hidden_bytes=hidden_bytes,
        physical_to_logical_map=pmap, expert_tokens=counts, slot_tokens=slot_tokens,
        dropped_tokens=np.zeros((L, E), dtype=np.int64), rerouted_tokens=np.zeros((L, E), dtype=np.int64),
        capacity_factor=np.zeros(L), local_tokens=None, sent_tokens=None, received_tokens=None, traffic=None,
        dispatch_seconds=None, combine_seconds=None, compute_seconds=None, layer_seconds=layer_seconds,
        step_seconds=None if step_seconds is None else np.asarray(step_seconds, dtype=np.float64),
        step_tokens=None if step_tokens is None else np.asarray(step_tokens, dtype=np.int64),
        extra=dict(extra or {}),
    )
    return Window(**fields)


class DirSink:
    """One JSON file per window in a folder, written to a temporary name and renamed, so a reader
    never sees half a window."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._seq = itertools.count()
        self.written = 0

    def __call__(self, window: Window) -> None:
        name = f"window-{time.time_ns()}-{os.getpid()}-{next(self._seq):06d}.json"
        tmp = self.folder / (name + ".tmp")
        tmp.write_text(window.to_json())
        os.replace(tmp, self.folder / name)
        self.written += 1


class WindowSinks:
    """The sinks the settings ask for: the agent's socket (through the runtime's non-blocking
    Sender, started on the first window) and/or a folder."""

    def __init__(self, settings: EngineSettings, hello: Callable[[], wire.Hello]):
        self.sender: Sender | None = Sender(settings.socket, hello=hello) if settings.socket else None
        self.folder = DirSink(settings.window_dir) if settings.window_dir else None
        self._started = False

    def __call__(self, window: Window) -> None:
        if self.folder is not None:
            self.folder(window)
        if self.sender is not None:
            if not self._started:
                self.sender.start()
                self._started = True
            self.sender.send_window(window)

    def close(self) -> None:
        if self.sender is not None and self._started:
            self.sender.close()
            self._started = False


def hello_for(window_like: Mapping, runtime: str) -> wire.Hello:
    """The Hello of an engine that takes no plans (no capabilities)."""
    return wire.Hello(runtime=runtime, model=window_like["model"], ep_group=window_like["ep_group"],
                      world_size=window_like["world_size"], num_layers=window_like["num_layers"],
                      num_experts=window_like["num_experts"], num_slots=window_like["num_slots"],
                      ranks_per_node=window_like["world_size"], pid=os.getpid(), capabilities=())


class EngineRecorder:
    """One process's counters and the window they add up to, for an adapter that marks steps.

    The adapter calls `counter(layer_id)` once per MoE layer when it binds (layers are numbered by
    the engine's own index; the window lists them in that order, their ids under `layer_ids`),
    `begin_step(n)` / `end_step()` around each real forward, and `close()` at shutdown. A window
    ends after `window_steps` steps or `window_seconds`, whichever comes first."""

    # A window waiting for its device step times is sent without them after this many more steps.
    HOLD_STEPS = 64

    def __init__(self, settings: EngineSettings, *, runtime: str, model: str, top_k: int, hidden_bytes: int,
                 num_experts: int, weights: PairWeights, world_size: int = 1, time_steps: bool = False,
                 sinks: Sequence[Callable[[Window], object]] = (), clock: EventClock | None = None):
        self.settings = settings
        # Device step time without a host sync (clock.py): a window is held until its steps' events
        # have completed, then sent with them (or, after HOLD_STEPS more steps, without them).
        self.clock = clock
        self._held: list[tuple[dict, int, int]] = []  # (window fields, its steps, steps run since held)
        self._timed: list[float] = []  # device step seconds harvested, not yet given to a window
        self._skip = 0  # device step times still to come for windows already sent without them
        self.runtime, self.model, self.top_k, self.hidden_bytes = runtime, model, top_k, hidden_bytes
        self.num_experts, self.world_size = num_experts, world_size
        self.weights = weights
        self.time_steps = time_steps
        self.counters: dict[int, PairCounter] = {}
        self.layer_seconds: dict[int, float] | None = None  # set by an adapter that times layers
        self.slot_map: Callable[[], np.ndarray] | None = None  # [L, P] map in force, when slots are counted
        # Window `extra` keys filled at each flush from what an adapter has pending (e.g. the EPLB
        # policy's decisions since the last window); a None or empty answer adds nothing.
        self.extra_fields: dict[str, Callable[[], Any]] = {}
        self._identity: dict = {}
        self.extra_sinks = list(sinks)
        self.sinks = (WindowSinks(settings, hello=lambda: hello_for(self._identity, runtime))
                      if settings.socket or settings.window_dir else None)
        self.windows_built = 0
        self.last_error = ""
        self._reset()

    def counter(self, layer_id: int, num_slots: int = 0) -> PairCounter:
        if layer_id not in self.counters:
            self.counters[layer_id] = PairCounter(self.num_experts, self.weights, num_slots)
        return self.counters[layer_id]

    def _reset(self) -> None:
        self.steps = 0
        self._step_seconds: list[float] = []
        self._step_tokens: list[int] = []
        self._start_unix = 0.0
        self._start_wall = 0.0
        if self.layer_seconds is not None:
            self.layer_seconds = dict.fromkeys(self.layer_seconds, 0.0)

    def begin_step(self, num_tokens: int) -> None:
        if self.steps == 0:
            self._start_unix, self._start_wall = time.time(), time.perf_counter()
        self._step_tokens.append(int(num_tokens))
        self.weights.arm(int(num_tokens))
        if self.clock is not None:
            self.clock.begin_step()
        self._step_start = time.perf_counter()

    def end_step(self) -> Window | None:
        self._step_seconds.append(time.perf_counter() - self._step_start)
        if self.clock is not None:
            self.clock.end_step()
            self._release_held(steps_run=1)
        self.weights.disarm()
        self.steps += 1
        s = self.settings
        if (s.window_steps is not None and self.steps >= s.window_steps) or (
                s.window_seconds is not None and time.perf_counter() - self._start_wall >= s.window_seconds):
            return self.flush()
        return None

    def flush(self) -> Window | None:
        """Build the window of the steps so far and hand it to the sinks (None when there were none)."""
        if self.steps == 0 or not self.counters:
            return None
        ids = sorted(self.counters)
        taken = [self.counters[i].take() for i in ids]
        slots = None
        pmap = None
        if self.slot_map is not None and all(t[1] is not None for t in taken):
            slots = np.stack([t[1] for t in taken])
            pmap = self.slot_map()
        layer_seconds = None
        if self.layer_seconds is not None:
            layer_seconds = np.array([[self.layer_seconds.get(i, 0.0)] for i in ids])
        fields = dict(
            runtime=self.runtime, model=self.model, ep_group=self.settings.ep_group, top_k=self.top_k,
            hidden_bytes=self.hidden_bytes, expert_tokens=np.stack([t[0] for t in taken]), steps=self.steps,
            start_time=self._start_unix, end_time=time.time(), world_size=self.world_size,
            slot_tokens=slots, physical_to_logical_map=pmap, layer_seconds=layer_seconds,
            step_seconds=self._step_seconds if self.time_steps else None, step_tokens=self._step_tokens,
            extra={"layer_ids": ids, **self._pending_extra()})
        steps = self.steps
        self._reset()
        if self.clock is not None and self.clock.enabled:
            self._held.append((fields, steps, 0))
            return self._release_held(steps_run=0)
        return self._emit(fields)

    def _release_held(self, steps_run: int) -> Window | None:
        """Send the held windows whose device step times are all in, oldest first, and those held for
        HOLD_STEPS steps (or with the clock off) without them. Returns the last window sent."""
        for seconds in self.clock.harvest():
            if self._skip:
                self._skip -= 1  # a step of a window already sent without its times
            else:
                self._timed.append(seconds)
        sent = None
        self._held = [(f, n, run + steps_run) for f, n, run in self._held]
        while self._held:
            fields, steps, run = self._held[0]
            if len(self._timed) >= steps:
                fields["step_seconds"], self._timed = self._timed[:steps], self._timed[steps:]
            elif run >= self.HOLD_STEPS or not self.clock.enabled:
                self._skip += steps - len(self._timed)
                self._timed = []
            else:
                break
            self._held.pop(0)
            sent = self._emit(fields) or sent
        return sent

    def _emit(self, fields: dict) -> Window | None:
        try:
            window = logical_window(**fields)
        except ValueError as exc:  # never take the engine down for a window: count it and go on
            self.last_error = str(exc)
            return None
        self._identity = {name: getattr(window, name) for name in
                          ("model", "ep_group", "world_size", "num_layers", "num_experts", "num_slots")}
        self.windows_built += 1
        if self.sinks is not None:
            self.sinks(window)
        for sink in self.extra_sinks:
            sink(window)
        return window

    def _pending_extra(self) -> dict[str, Any]:
        out = {}
        for name, take in self.extra_fields.items():
            value = take()
            if value:
                out[name] = value
        return out

    def close(self) -> None:
        self.flush()
        if self._held:  # shutdown: what has completed goes with its times, the rest without (no wait)
            self._release_held(steps_run=self.HOLD_STEPS)
        if self.sinks is not None:
            self.sinks.close()


Sink = Callable[[Window], object]


def env_sinks(hello: Callable[[], wire.Hello],
              environ: Mapping[str, str] | None = None) -> tuple[list[Sink], list[Callable[[], None]]]:
    """(sinks, closers) from MOEWATCH_SOCKET / MOEWATCH_WINDOW_DIR, for an adapter that ends its
    windows itself (the SGLang hook flushes on a timer); both empty when neither is set."""
    env = os.environ if environ is None else environ
    socket_path, folder = env.get(ENV_SOCKET) or None, env.get(ENV_WINDOW_DIR) or None
    if socket_path is None and folder is None:
        return [], []
    sinks = WindowSinks(EngineSettings(socket=socket_path, window_dir=folder), hello)
    return [sinks], [sinks.close]
