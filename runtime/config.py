"""What one run of the reference runtime is: sizes, workload, capacity, probe, control, launch.

`RuntimeConfig` is the single description shared by the CLI (`moewatch runtime`), the library entry
point (`moewatch.runtime.launcher.launch`) and every rank process. `validate` rejects a bad config with a
`ConfigError` naming the field, before any process is spawned.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moewatch.errors import ConfigError
from moewatch.plan import A2A_SCHEDULES

OVERFLOW_POLICIES = ("drop", "reroute")
WORKLOADS = ("zipf", "drift", "trace")
ROUTERS = ("learned", "synthetic")
SCORES = ("softmax", "sigmoid")
KERNELS = ("torch", "triton")
BACKENDS = ("gloo", "nccl")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class RuntimeConfig:
    # --- sizes (L, E, P, k, d, ffn) and the EP group (W) -----------------------------------------
    ranks: int = 4
    layers: int = 8
    experts: int = 32
    slots: int | None = None  # physical slots P; None means one per expert (no replicas)
    top_k: int = 2
    hidden: int = 128
    ffn: int = 256
    ranks_per_node: int | None = None  # None: every rank on one node
    score: str = "softmax"  # router score function: softmax or sigmoid
    dtype: str = "float32"
    # --- the drive ----------------------------------------------------------------------------------
    steps: int = 200  # 0: run until `seconds` (or a stop signal)
    seconds: float | None = None
    warmup_steps: int = 2  # left out of the latency and throughput figures
    batch_tokens: int = 256  # token slots per rank per step (padding included)
    pad_fraction: float = 0.0  # share of each batch that is padding (kept out of every count)
    # --- routing -----------------------------------------------------------------------------------
    router: str = "synthetic"  # synthetic: the workload's expert ids bypass the learned router
    workload: str = "zipf"
    zipf: float = 1.0
    hot_experts: int = 0
    hot_share: float = 0.5  # share of all pairs that the hot experts carry together
    drift_every: int = 50  # steps between moves of the hot set (workload "drift")
    affinity: float = 0.0  # probability that a token's next-layer expert follows its current one
    trace: str | None = None  # .npy [tokens, layers, top_k] expert ids (workload "trace")
    # --- capacity ----------------------------------------------------------------------------------
    capacity_factor: float = 0.0  # 0 is dropless; per layer afterwards, through plans
    overflow: str = "drop"
    # --- placement and control --------------------------------------------------------------------
    placement: Any = None  # initial physical_to_logical_map [L][P]; None: slot s holds expert s % E
    # Start with each layer's hot experts (synthetic routing) on this rank: a skewed start the agent
    # can fix, for benchmarks and the demo. Ignored when `placement` is given.
    hot_on_rank: int | None = None
    migrate_layers_per_step: int = 1  # bound on the stall a plan adds to one step
    # (step, plan dict) pairs injected into rank 0's plan inbox as if they came from the agent
    scripted_plans: list = field(default_factory=list)
    # {"rank": r, "epoch": e, "stage": "prepare" | "transfer"}: make that rank fail migrating to epoch e;
    # "stall" (with "seconds", "marker": a file written first) makes it hang before the weight exchange
    inject_migration_failure: dict | None = None
    # --- probe and telemetry ----------------------------------------------------------------------
    probe: bool = True
    window_steps: int | None = None  # None with no window_seconds: 50
    window_seconds: float | None = None
    traffic_max_ranks: int = 16  # carry the rank-to-rank matrix up to this many ranks
    socket: str | None = None  # the agent's unix socket or tcp://HOST:PORT (the runtime connects as a client)
    windows_out: str | None = None  # also append every Window as one JSON line to this file
    return_windows: bool = False  # hand every Window (as a dict) back in the result (tests, demos)
    queue_size: int = 64
    heartbeat_seconds: float = 1.0
    model_name: str = "moewatch-ref"
    ep_group: str = "ep0"
    # --- execution ----------------------------------------------------------------------------------
    kernel: str = "torch"
    backend: str = "gloo"
    # None: one thread per rank when each rank has its own cores (pinned), else 1 (ranks time-share)
    threads_per_rank: int | None = None
    collective_timeout_s: float = 120.0
    seed: int = 0
    # --- emulated slow device (runtime/slowdown.py) -------------------------------------------------
    slow_rank: int | None = None  # this rank's expert compute runs slow_factor times as long
    slow_factor: float = 1.0
    # JSON {"<rank>": factor}, re-read at step boundaries when its mtime changes; overrides the two above
    slowdown_file: str | None = None
    # --- the all-to-all and its links (runtime/dispatch.py, runtime/netlinks.py) --------------------
    a2a_schedule: str = "none"  # "aurora": Aurora's point-to-point rounds instead of one collective
    # Each rank in its own network namespace, its link shaped to this many Mbit/s each way (root only)
    link_rate_mbit: float | None = None
    # [W] bytes per second each rank's link carries (measured by the emulated links, or declared for
    # real ones): with it, each layer's all-to-all bound goes into the windows; None: bound absent
    link_bytes_per_second: list | None = None
    a2a_log: bool = False  # keep every row exchange's span and bound (benchmarks; grows with steps)
    # With known link rates, what one scheduled round costs besides its rows (two ranks meeting): the
    # planner then runs whole-transfer rounds when they beat the bound-reaching split with that counted
    a2a_round_seconds: float = 0.002

    # --- derived -----------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.experts if self.slots is None else self.slots

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.ranks

    @property
    def node_size(self) -> int:
        return self.ranks if self.ranks_per_node is None else self.ranks_per_node

    @property
    def effective_window_steps(self) -> int | None:
        if self.window_steps is None and self.window_seconds is None:
            return 50
        return self.window_steps

    def initial_placement(self) -> np.ndarray:
        """[L, P] the map in force at epoch 0."""
        if self.placement is None:
            row = np.arange(self.num_slots, dtype=np.int64) % self.experts
            return np.tile(row, (self.layers, 1))
        return np.asarray(self.placement, dtype=np.int64)

    def replace(self, **changes: Any) -> "RuntimeConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if isinstance(out["placement"], np.ndarray):
            out["placement"] = out["placement"].tolist()
        return out


def validate(cfg: RuntimeConfig) -> RuntimeConfig:
    """Raise ConfigError naming the first bad field; return cfg unchanged when it is sound."""
    for name in ("ranks", "layers", "experts", "top_k", "hidden", "ffn", "batch_tokens",
                 "migrate_layers_per_step", "queue_size", "traffic_max_ranks"):
        _positive_int(cfg, name)
    for name in ("steps", "warmup_steps", "seed", "drift_every", "hot_experts"):
        _non_negative_int(cfg, name)
    for name in ("slots", "ranks_per_node", "window_steps", "threads_per_rank"):
        if getattr(cfg, name) is not None:
            _positive_int(cfg, name)
    _choice(cfg, "overflow", OVERFLOW_POLICIES)
    _choice(cfg, "workload", WORKLOADS)
    _choice(cfg, "router", ROUTERS)
    _choice(cfg, "score", SCORES)
    _choice(cfg, "kernel", KERNELS)
    _choice(cfg, "backend", BACKENDS)
    _choice(cfg, "dtype", DTYPES)
    _choice(cfg, "a2a_schedule", A2A_SCHEDULES)

    W, E, P, k = cfg.ranks, cfg.experts, cfg.num_slots, cfg.top_k
    if k > E:
        raise ConfigError("top_k", f"top_k {k} exceeds the {E} experts")
    if P < E:
        raise ConfigError("slots", f"{P} slots cannot hold {E} experts")
    if P % W:
        raise ConfigError("slots", f"{P} slots do not divide over {W} ranks")
    if cfg.ranks_per_node is not None and W % cfg.ranks_per_node:
        raise ConfigError("ranks_per_node", f"{W} ranks do not split into nodes of {cfg.ranks_per_node}")
    if cfg.steps == 0 and cfg.seconds is None:
        raise ConfigError("steps", "0 steps needs --seconds to know when to stop")
    _finite(cfg, "capacity_factor", lower=0.0)
    _finite(cfg, "zipf", lower=0.0)
    _finite(cfg, "collective_timeout_s", lower=1.0)
    _finite(cfg, "heartbeat_seconds", lower=0.01)
    for name in ("hot_share", "affinity", "pad_fraction"):
        _finite(cfg, name, lower=0.0, upper=1.0)
    if cfg.pad_fraction >= 1.0:
        raise ConfigError("pad_fraction", "must be below 1 (a batch needs at least one real token)")
    for name in ("seconds", "window_seconds"):
        if getattr(cfg, name) is not None:
            _finite(cfg, name, lower=0.0)
            if getattr(cfg, name) <= 0:
                raise ConfigError(name, "must be positive")
    if cfg.hot_experts >= E and cfg.hot_experts:
        raise ConfigError("hot_experts", f"{cfg.hot_experts} hot experts leave no cold ones among {E}")
    if cfg.workload == "trace":
        if not cfg.trace:
            raise ConfigError("trace", "the trace workload needs a .npy file of expert ids")
        if cfg.router == "learned":
            raise ConfigError("router", "a trace replays expert ids: use --router synthetic")
    elif cfg.trace:
        raise ConfigError("trace", "a trace file is only read by --workload trace")
    if cfg.backend == "gloo" and cfg.dtype != "float32":
        raise ConfigError("dtype", "the CPU (gloo) runtime computes in float32")
    if cfg.placement is not None:
        try:
            pmap = np.asarray(cfg.placement)
        except ValueError:
            raise ConfigError("placement", "ragged matrix") from None
        if pmap.shape != (cfg.layers, P) or pmap.dtype.kind not in "iu":
            raise ConfigError("placement", f"expected an integer [{cfg.layers}][{P}] matrix, got {list(pmap.shape)}")
        if np.any(pmap < 0) or np.any(pmap >= E):
            raise ConfigError("placement", f"expert ids must lie in [0, {E})")
        for layer in range(cfg.layers):
            if len(np.unique(pmap[layer])) != E:
                raise ConfigError("placement", f"layer {layer}: every expert needs at least one slot")
    if cfg.hot_on_rank is not None:
        _non_negative_int(cfg, "hot_on_rank")
        if cfg.hot_on_rank >= W:
            raise ConfigError("hot_on_rank", f"rank {cfg.hot_on_rank} is not one of the {W} ranks")
        if not cfg.hot_experts or cfg.router != "synthetic" or cfg.workload == "trace":
            raise ConfigError("hot_on_rank", "needs synthetic routing with --hot-experts")
        if cfg.hot_experts > P // W:
            raise ConfigError("hot_on_rank", f"{cfg.hot_experts} hot experts do not fit in {P // W} slots per rank")
    if cfg.socket is not None:
        from .sender import agent_address
        try:
            agent_address(cfg.socket)
        except ValueError as exc:
            raise ConfigError("socket", str(exc)) from None
    if cfg.inject_migration_failure is not None:
        spec = cfg.inject_migration_failure
        if not isinstance(spec, dict) or not {"rank", "epoch"} <= set(spec):
            raise ConfigError("inject_migration_failure", "expected {'rank': r, 'epoch': e[, 'stage': ...]}")
        if spec.get("stage", "transfer") not in ("prepare", "transfer", "stall"):
            raise ConfigError("inject_migration_failure", "stage must be 'prepare', 'transfer' or 'stall'")
    _finite(cfg, "slow_factor", lower=1.0)
    if cfg.slow_rank is not None:
        _non_negative_int(cfg, "slow_rank")
        if cfg.slow_rank >= W:
            raise ConfigError("slow_rank", f"rank {cfg.slow_rank} is not one of the {W} ranks")
    if cfg.slowdown_file is not None and (not isinstance(cfg.slowdown_file, str) or not cfg.slowdown_file):
        raise ConfigError("slowdown_file", "expected a file path")
    if cfg.link_rate_mbit is not None:
        _finite(cfg, "link_rate_mbit", lower=1.0)
        if cfg.backend != "gloo":
            raise ConfigError("link_rate_mbit", "emulated links carry gloo's TCP traffic: use --backend gloo")
        if cfg.socket is not None and cfg.socket.startswith("tcp://"):
            raise ConfigError("link_rate_mbit", "ranks in their own network namespaces reach the agent "
                                                "only over a unix socket path, not tcp://")
    _finite(cfg, "a2a_round_seconds", lower=0.0)
    if cfg.link_bytes_per_second is not None:
        rates = cfg.link_bytes_per_second
        if (not isinstance(rates, (list, tuple)) or len(rates) != W
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                           for v in rates)):
            raise ConfigError("link_bytes_per_second", f"expected {W} positive finite rates, one per rank")
    for item in cfg.scripted_plans:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], dict)):
            raise ConfigError("scripted_plans", "expected (step, plan dict) pairs")
    return cfg


def _positive_int(cfg: RuntimeConfig, name: str) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(name, f"must be a positive integer, got {value!r}")


def _non_negative_int(cfg: RuntimeConfig, name: str) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(name, f"must be a non-negative integer, got {value!r}")


def _finite(cfg: RuntimeConfig, name: str, lower: float, upper: float | None = None) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ConfigError(name, f"must be a number, got {value!r}")
    if not math.isfinite(value) or value < lower or (upper is not None and value > upper):
        bound = f"in [{lower}, {upper}]" if upper is not None else f">= {lower}"
        raise ConfigError(name, f"must be finite and {bound}, got {value!r}")


def _choice(cfg: RuntimeConfig, name: str, allowed: tuple[str, ...]) -> None:
    if getattr(cfg, name) not in allowed:
        raise ConfigError(name, f"must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}")
