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
import logging
import os
import threading
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
from .readout import HostReadout

log = logging.getLogger(__name__)

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
    profiling, dummy runs and padded tokens add nothing. The counts only grow: a flush copies them
    without a host sync and takes the difference from its previous copy (readout.py)."""

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

    def add(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None, *,
            pair_weights: torch.Tensor | None = None) -> None:
        """Count the router's choice [N, c]. Ids outside [0, E) (padding rows masked to -1) go to
        `discarded`; so do columns past top_k, which a router appends after its choice (fused shared
        experts, ids E..E+s) and, given `topk_weights`, pairs of weight exactly 0 (a zero-expert
        router hands its zero experts on as expert 0 with weight 0). `pair_weights` [N * top_k]:
        the rows' weights when they are not the buffer's head (an adapter that counts some rows of a
        gathered batch, or a micro-batch's real rows)."""
        self._tally(self._expert_bins, topk_ids, topk_weights, pair_weights)

    def add_slots(self, physical_ids: torch.Tensor, topk_weights: torch.Tensor | None = None, *,
                  pair_weights: torch.Tensor | None = None) -> None:
        """Count the slots the ids were mapped to, as `add` counts experts (the same pairs discarded)."""
        self._tally(self._slot_bins, physical_ids, topk_weights, pair_weights)

    def _tally(self, bins: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor | None,
               pair_weights: torch.Tensor | None = None) -> None:
        # In-place on preallocated scratch: the ids are copied (never changed: the engine uses them),
        # clamped to [-1, outside] and taken mod outside + 1, which sends -1 and >= outside to the
        # outside bin and keeps [0, outside) as is. No host sync, no allocation.
        outside = bins.shape[0] - 1
        extra = 0
        if ids.dim() == 2 and self.top_k is not None and ids.shape[1] > self.top_k:
            extra, ids = ids.shape[1] - self.top_k, ids[:, :self.top_k]
        flat = ids.reshape(-1)
        n = flat.shape[0]
        index = self._scratch[:n]
        index.copy_(flat)
        index.clamp_(-1, outside).remainder_(outside + 1)
        if topk_weights is not None:
            zero = self._zero_weight[:n]
            torch.eq(topk_weights[..., :ids.shape[-1]].reshape(-1), 0, out=zero)
            index.masked_fill_(zero, outside)
        weights = self.weights if pair_weights is None else pair_weights
        bins.index_add_(0, index, weights[:n])
        if extra:  # each real token's appended columns: `extra` pairs outside, per token's weight
            tokens = ids.shape[0]
            rest = self._scratch[n:n + tokens].fill_(outside)
            bins.index_add_(0, rest, weights.view(-1, self.top_k)[:tokens, 0], alpha=extra)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The device tensors a flush reads, by the window field they feed. Cumulative since the
        counter was made (never zeroed: the recorder subtracts its previous read, readout.py)."""
        out = {"expert_tokens": self.counts, "discarded_pairs": self.discarded}
        if self.slot_counts is not None:
            out["slot_tokens"] = self.slot_counts
        return out


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
                   extra: Mapping | None = None, ranks_per_node: int | None = None) -> Window:
    """A Window from what an engine adapter measured. expert_tokens [L, E] always; slot_tokens [L, P]
    with the map [L, P] in force when the engine has redundant slots (else P = E, identity map, and
    rank-level counts are absent); layer_seconds [L, W] only when timed without a sync; per-step
    data only when measured. Engines here drop no pairs and have no capacity factor: zeros.
    ranks_per_node: from the engine's config (None: the whole group on one node)."""
    counts = np.asarray(expert_tokens, dtype=np.int64)
    L, E = counts.shape
    if physical_to_logical_map is None:
        pmap = np.tile(np.arange(E, dtype=np.int64), (L, 1))
    else:
        pmap = np.asarray(physical_to_logical_map, dtype=np.int64)
    P = pmap.shape[1]
    fields = dict(
        runtime=runtime, model=model, ep_group=ep_group, world_size=world_size, ranks_per_node=ranks_per_node or world_size,
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
    Sender, started on the first window, or by `start()`) and/or a folder. `heartbeat`: what the
    Sender reports every second while connected (the windows lost so far, by reason)."""

    def __init__(self, settings: EngineSettings, hello: Callable[[], wire.Hello],
                 heartbeat: Callable[[], wire.Heartbeat] | None = None):
        self.sender: Sender | None = (Sender(settings.socket, hello=hello, heartbeat=heartbeat)
                                      if settings.socket else None)
        self.folder = DirSink(settings.window_dir) if settings.window_dir else None
        self._started = False

    def start(self) -> None:
        if self.sender is not None and not self._started:
            self.sender.start()
            self._started = True

    def __call__(self, window: Window) -> None:
        if self.folder is not None:
            self.folder(window)
        if self.sender is not None:
            self.start()
            self.sender.send_window(window)

    def close(self) -> None:
        if self.sender is not None and self._started:
            self.sender.close()
            self._started = False


def hello_for(window_like: Mapping, runtime: str) -> wire.Hello:
    """The Hello of an engine that takes no plans (no capabilities); a process that sends shards
    (window_like["shard"]) says which shard of how many it sends."""
    shard = window_like.get("shard") or {}
    return wire.Hello(runtime=runtime, model=window_like["model"], ep_group=window_like["ep_group"],
                      world_size=window_like["world_size"], num_layers=window_like["num_layers"],
                      num_experts=window_like["num_experts"], num_slots=window_like["num_slots"],
                      ranks_per_node=window_like.get("ranks_per_node") or window_like["world_size"],
                      shard_index=shard.get("index", 0), shard_count=shard.get("count", 1),
                      pid=os.getpid(), capabilities=())


class EngineRecorder:
    """One process's counters and the window they add up to, for an adapter that marks steps.

    The adapter calls `counter(layer_id)` once per MoE layer when it binds (layers are numbered by
    the engine's own index; the window lists them in that order, their ids under `layer_ids`),
    `begin_step(n)` / `end_step()` around each real engine step (`end_forward()` in between when the
    step goes on after the forward, e.g. to sample: it stops counting pairs), and `close()` at
    shutdown. A window ends after `window_steps` steps or `window_seconds`, whichever comes first.

    Nothing on the step path waits for the device: the flush starts a non-blocking copy of every
    counter (readout.py) and the window is sent once that copy, and the step clock's events, have
    completed. A background timer sends what has completed and ends a window whose seconds are up
    while the engine is idle (between steps only, on the engine's stream), so a quiet engine sends
    its window within MOEWATCH_WINDOW_SECONDS instead of holding it until its next step.

    A window that cannot be built or sent is never dropped in silence: it is counted by reason
    (`windows_lost()`, reasons in wire.WINDOW_LOSS_REASONS), logged once per reason, and the counts
    go to the agent in every heartbeat (`extra["windows_lost"]`)."""

    # A window waiting for its device step times is sent without them after this many more steps.
    HOLD_STEPS = 64
    # The timer's period at most (shorter for short windows).
    TIMER_SECONDS = 0.25

    def __init__(self, settings: EngineSettings, *, runtime: str, model: str, top_k: int, hidden_bytes: int,
                 num_experts: int, weights: PairWeights, world_size: int = 1, time_steps: bool = False,
                 sinks: Sequence[Callable[[Window], object]] = (), clock: EventClock | None = None,
                 timer: bool = True):
        self.settings = settings
        # Device step time without a host sync (clock.py): a window is held until its steps' events
        # have completed, then sent with them (or, after HOLD_STEPS more steps, without them).
        self.clock = clock
        # (window fields, its steps, its counters' readout, steps run since held), oldest first
        self._held: list[list] = []
        self._timed: list[float] = []  # device step seconds harvested, not yet given to a window
        self._skip = 0  # device step times still to come for windows already sent without them
        self.runtime, self.model, self.top_k, self.hidden_bytes = runtime, model, top_k, hidden_bytes
        self.num_experts, self.world_size = num_experts, world_size
        self.ranks_per_node: int | None = None  # from the engine's config (None: the whole group on one node)
        self.weights = weights
        self.time_steps = time_steps
        self.counters: dict[int, PairCounter] = {}
        self.layer_seconds: dict[int, float] | None = None  # set by an adapter that times layers
        # [L, P] map in force, when slots are counted: a device tensor (copied with the counters,
        # no sync) or an array.
        self.slot_map: Callable[[], Any] | None = None
        # [P] logical expert of each slot where the engine places experts other than contiguously
        # and no slot counts (hence no map read from the device) come: the window states it.
        self.placement: np.ndarray | None = None
        # Window `extra` keys filled at each flush from what an adapter has pending (e.g. the EPLB
        # policy's decisions since the last window); a None or empty answer adds nothing.
        self.extra_fields: dict[str, Callable[[], Any]] = {}
        self._identity: dict = {}
        self.extra_sinks = list(sinks)
        self.sinks = (WindowSinks(settings, hello=lambda: hello_for(self._identity, runtime), heartbeat=self.heartbeat)
                      if settings.socket or settings.window_dir else None)
        self.readout = HostReadout(weights.tensor.device)
        self._read_upto: dict[tuple[str, int], np.ndarray] = {}  # the cumulative counts last read
        self._stream: Any = None  # the engine's CUDA stream, as of its last step
        self.windows_built = 0
        self.last_error = ""
        self._lost: dict[str, int] = {}
        self._steps_total = 0
        self._in_step = False
        # _lock guards the recorder's state (held briefly); _emit_lock orders the sending (the engine's
        # thread never waits for it: the timer sends when it holds it).
        self._lock = threading.RLock()
        self._emit_lock = threading.Lock()
        self._timer_wanted = timer
        self._timer: threading.Thread | None = None
        self._closed = threading.Event()
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

    # --- the engine's thread ---------------------------------------------------------------------
    def begin_step(self, num_tokens: int) -> None:
        with self._lock:
            if self._timer is None and self._timer_wanted and not self._closed.is_set():
                self._start_timer()
            self._in_step = True
            if self.steps == 0:
                self._start_unix, self._start_wall = time.time(), time.perf_counter()
            self._step_tokens.append(int(num_tokens))
            self.weights.arm(int(num_tokens))
            if self.clock is not None:
                self.clock.begin_step()
            self._step_start = time.perf_counter()

    def end_forward(self) -> None:
        """The step's forward is launched: what the step runs after it (sampling, drafting) counts no pairs."""
        self.weights.disarm()

    def end_step(self) -> Window | None:
        with self._lock:
            self._step_seconds.append(time.perf_counter() - self._step_start)
            if self.clock is not None:
                self.clock.end_step()
            self.weights.disarm()
            if self.readout.device.type == "cuda":  # the stream a timer's flush must copy on
                self._stream = torch.cuda.current_stream(self.readout.device)
            self.steps += 1
            self._steps_total += 1
            self._in_step = False
            for held in self._held:
                held[3] += 1
            s = self.settings
            if (s.window_steps is not None and self.steps >= s.window_steps) or (
                    s.window_seconds is not None and time.perf_counter() - self._start_wall >= s.window_seconds):
                self._flush_locked()
            pending = bool(self._held)
        return self._send_ready(wait=False) if pending else None

    def flush(self) -> Window | None:
        """End the window of the steps so far (nothing when there were none) and send what has
        completed; returns the last window sent now."""
        with self._lock:
            self._flush_locked()
        return self._send_ready(wait=True)

    def _flush_locked(self) -> None:
        """Start the window's counter copy and hold its fields until the copy (and the step times)
        are in. Called with _lock held, between steps."""
        if self.steps == 0 or not self.counters:
            return
        ids = sorted(self.counters)
        parts: list[tuple[Any, torch.Tensor]] = []
        for i in ids:
            parts += [((name, i), tensor) for name, tensor in self.counters[i].buffers().items()]
        pmap = None
        if self.slot_map is not None and all(self.counters[i].slot_counts is not None for i in ids):
            pmap = self.slot_map()
            if isinstance(pmap, torch.Tensor):
                parts.append((("map", -1), pmap))
                pmap = None
            elif pmap is None:
                pmap = False  # no map this time: the window goes without slot counts
        layer_seconds = None
        if self.layer_seconds is not None:
            layer_seconds = np.array([[self.layer_seconds.get(i, 0.0)] for i in ids])
        fields = dict(
            runtime=self.runtime, model=self.model, ep_group=self.settings.ep_group, top_k=self.top_k,
            hidden_bytes=self.hidden_bytes, steps=self.steps,
            start_time=self._start_unix, end_time=time.time(), world_size=self.world_size,
            ranks_per_node=self.ranks_per_node, physical_to_logical_map=pmap, layer_seconds=layer_seconds,
            step_seconds=self._step_seconds if self.time_steps else None, step_tokens=self._step_tokens,
            extra={"layer_ids": ids, **self._pending_extra()})
        try:
            readout = self.readout.start(parts, stream=self._stream)
        except Exception as exc:  # the copy could not even start: this window is lost, counted
            self._count_lost("readout_error", exc)
            self._reset()
            return
        self._held.append([fields, self.steps, readout, 0])
        self._reset()

    def _counts_of(self, fields: dict, readout) -> None:
        """Fill the window's counts from its completed readout: this read minus the previous one."""
        got = readout.read()
        ids = fields["extra"]["layer_ids"]

        def since_last(name: str, i: int) -> np.ndarray:
            now = got[(name, i)]
            before = self._read_upto.get((name, i))
            self._read_upto[(name, i)] = now
            return now if before is None else now - before

        fields["expert_tokens"] = np.stack([since_last("expert_tokens", i) for i in ids])
        # Pairs whose id named no logical expert, per layer (PairCounter's discard bin): never silent.
        discarded = [int(since_last("discarded_pairs", i)[0]) for i in ids if ("discarded_pairs", i) in got]
        if len(discarded) == len(ids):
            fields["extra"]["discarded_pairs"] = discarded
        slots = [since_last("slot_tokens", i) for i in ids if ("slot_tokens", i) in got]
        pmap = got.get(("map", -1), fields["physical_to_logical_map"])
        if len(slots) == len(ids) and pmap is not None and pmap is not False:
            fields["slot_tokens"], fields["physical_to_logical_map"] = np.stack(slots), pmap
        else:
            static = None if self.placement is None else np.tile(self.placement, (len(ids), 1))
            fields["slot_tokens"], fields["physical_to_logical_map"] = None, static

    def _take_ready(self) -> list[dict]:
        """Under _lock: the held windows whose counters are in and whose device step times are all in
        (or that were held HOLD_STEPS steps, or with the clock off: without them), oldest first."""
        if self.clock is not None:
            for seconds in self.clock.harvest():
                if self._skip:
                    self._skip -= 1  # a step of a window already sent without its times
                else:
                    self._timed.append(seconds)
        ready = []
        while self._held:
            fields, steps, readout, run = self._held[0]
            if not readout.ready():
                break
            if self.clock is not None:
                if len(self._timed) >= steps:
                    fields["step_seconds"], self._timed = self._timed[:steps], self._timed[steps:]
                elif run >= self.HOLD_STEPS or not self.clock.enabled:
                    self._skip += steps - len(self._timed)
                    self._timed = []
                else:
                    break
            self._held.pop(0)
            self._counts_of(fields, readout)
            ready.append(fields)
        return ready

    def _send_ready(self, wait: bool) -> Window | None:
        """Send the windows that are ready, in order. With wait False (the engine's thread) it does not
        wait for the timer's sending: the timer sends them then."""
        if not self._emit_lock.acquire(blocking=wait):
            return None
        try:
            with self._lock:
                ready = self._take_ready()
            sent = None
            for fields in ready:
                sent = self._emit(fields) or sent
            return sent
        finally:
            self._emit_lock.release()

    def _emit(self, fields: dict) -> Window | None:
        try:
            window = logical_window(**fields)
        except (ValueError, TypeError) as exc:  # never take the engine down for a window: count it and go on
            self._count_lost("invalid", exc)
            if not self._identity and self.sinks is not None:
                # The agent hears the counts in the heartbeats of a connection that no window opened.
                pmap = fields.get("physical_to_logical_map")
                self._identity = {"model": fields["model"], "ep_group": fields["ep_group"],
                                  "world_size": fields["world_size"], "num_layers": len(fields["extra"]["layer_ids"]),
                                  "num_experts": self.num_experts,
                                  "num_slots": self.num_experts if pmap is None else int(np.shape(pmap)[-1])}
                self.sinks.start()
            return None
        self._identity = {name: getattr(window, name) for name in
                          ("model", "ep_group", "world_size", "num_layers", "num_experts", "num_slots",
                           "ranks_per_node")}
        self._identity["shard"] = window.extra.get("shard")
        self.windows_built += 1
        for sink in ([self.sinks] if self.sinks is not None else []) + self.extra_sinks:
            try:
                sink(window)
            except Exception as exc:  # a full disk, a sink's own bug: counted, and the engine goes on
                self._count_lost("sink_error", exc)
        return window

    def _count_lost(self, reason: str, exc: BaseException) -> None:
        with self._lock:
            self.last_error = f"{type(exc).__name__}: {exc}"
            first = reason not in self._lost
            self._lost[reason] = self._lost.get(reason, 0) + 1
        if first:
            log.warning("moewatch: a window was lost (%s: %s); windows lost for this reason are counted "
                        "(moewatch_runtime_windows_lost_total) and not logged again", reason, self.last_error)

    def windows_lost(self) -> dict[str, int]:
        """Windows lost so far in this process, by reason (cumulative): the recorder's own and its
        sender's (queue full, a send cut short, unsent at close)."""
        with self._lock:
            out = dict(self._lost)
        sender = self.sinks.sender if self.sinks is not None else None
        if sender is not None:
            for reason, count in dict(sender.stats.window_drops).items():
                out[reason] = out.get(reason, 0) + count
        return {reason: count for reason, count in out.items() if count}

    def heartbeat(self) -> wire.Heartbeat:
        sender = self.sinks.sender if self.sinks is not None else None
        return wire.Heartbeat(time=time.time(), epoch=0, step=self._steps_total,
                              frames_dropped=sender.stats.frames_dropped if sender is not None else 0,
                              extra={"windows_lost": self.windows_lost()})

    def _pending_extra(self) -> dict[str, Any]:
        out = {}
        for name, take in self.extra_fields.items():
            value = take()
            if value:
                out[name] = value
        return out

    # --- the timer's thread ----------------------------------------------------------------------
    def _start_timer(self) -> None:
        seconds = self.settings.window_seconds
        self._tick = min(self.TIMER_SECONDS, seconds / 4) if seconds is not None else self.TIMER_SECONDS
        self._timer = threading.Thread(target=self._run_timer, name="moewatch-window-timer", daemon=True)
        self._timer.start()

    def _run_timer(self) -> None:
        while not self._closed.wait(self._tick):
            try:
                self.on_timer()
            except Exception as exc:  # the engine never sees the timer fail; the next tick tries again
                self._count_lost("timer_error", exc)

    def on_timer(self) -> None:
        """One tick: end the open window if its seconds are up and no step is running, then send
        what has completed."""
        with self._lock:
            s = self.settings
            if (not self._in_step and self.steps and s.window_seconds is not None
                    and time.perf_counter() - self._start_wall >= s.window_seconds):
                self._flush_locked()
            pending = bool(self._held)
        if pending:
            self._send_ready(wait=True)

    def close(self) -> None:
        self._closed.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join(5.0)
        self.flush()
        if self._held:  # shutdown: counters waited for (off the step path), step times only if complete
            with self._lock:
                for held in self._held:
                    if not held[2].ready():
                        held[2].wait()
                    held[3] = self.HOLD_STEPS
            self._send_ready(wait=True)
        if self.sinks is not None:
            self.sinks.close()


Sink = Callable[[Window], object]


def env_sinks(hello: Callable[[], wire.Hello], environ: Mapping[str, str] | None = None,
              heartbeat: Callable[[], wire.Heartbeat] | None = None) -> tuple[list[Sink], list[Callable[[], None]]]:
    """(sinks, closers) from MOEWATCH_SOCKET / MOEWATCH_WINDOW_DIR, for an adapter that ends its
    windows itself (the SGLang hook flushes on a timer); both empty when neither is set.
    `heartbeat`: what the socket's sender reports every second (WindowSinks)."""
    env = os.environ if environ is None else environ
    socket_path, folder = env.get(ENV_SOCKET) or None, env.get(ENV_WINDOW_DIR) or None
    if socket_path is None and folder is None:
        return [], []
    sinks = WindowSinks(EngineSettings(socket=socket_path, window_dir=folder), hello, heartbeat=heartbeat)
    return [sinks], [sinks.close]
