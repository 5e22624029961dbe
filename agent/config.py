"""The agent's configuration: one validated object of sections, from a YAML file, MOEWATCH_* variables and flags.

Every setting lives in a section (`server`, `limits`, `policy`, ... and one per engine, e.g. `sglang`) and
has one name per source, all spelled from its path `<section>.<field>`:
- YAML: the key `<field>` under `<section>:`;
- environment: `MOEWATCH_<SECTION>__<FIELD>` (upper case, a double underscore between the two);
- flag: `--<section>.<field>` with dashes for underscores (`--policy.persist-windows`); the flags
  operators type most keep a short alias (`--mode`, `--socket`, `--listen`, see FLAG_ALIASES).
Precedence, lowest first: built-in defaults, the YAML file (`--config`), the environment, the flags.
Everything is checked once, here: a bad value stops the agent with an error that names the field by
its full path and where the value came from (`MOEWATCH_POLICY__MODE: ...`, `--server.listen: ...`). The
settings of the flat namespace before sections are refused with the name they moved to.
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

import yaml

from moewatch.integrations import registry
from moewatch.settings import check_section, coerce, default_of, section_fields, setting
from moewatch.thresholds import ConfigError, Thresholds, read_yaml_mapping

MODES = ("observe", "recommend", "act")
LOG_LEVELS = ("debug", "info", "warning", "error")
ENV_PREFIX = "MOEWATCH_"
THRESHOLDS = "thresholds"
# Short flags operators type constantly: each is a second spelling of one sectioned flag.
FLAG_ALIASES = {"--mode": "policy.mode", "--socket": "server.socket", "--listen": "server.listen"}


def default_socket_path() -> str:
    # systemd's RuntimeDirectory= exports RUNTIME_DIRECTORY (colon-separated when there are several).
    base = (os.environ.get("RUNTIME_DIRECTORY") or "").split(":")[0] or "/run/moewatch"
    return str(Path(base) / "moewatch.sock")


def default_audit_path() -> str:
    base = (os.environ.get("STATE_DIRECTORY") or "").split(":")[0] or "/var/lib/moewatch"
    return str(Path(base) / "audit.jsonl")


def octal_mode(value: str) -> str:
    try:
        bits = int(value, 8)
    except ValueError:
        raise ValueError(f"{value!r} is not an octal mode like 0660") from None
    if not 0 <= bits <= 0o777:
        raise ValueError(f"{value!r} is outside 0000-0777")
    return f"{bits:04o}"


def parse_listen(value: str, name: str = "server.listen") -> tuple[str, int]:
    """'HOST:PORT' (IPv6 as [::1]:PORT) -> (host, port); raises ConfigError naming the field. For
    server.tcp_listen a bare PORT means loopback: another address is only ever listened on when named."""
    text = str(value).strip()
    if name.endswith("tcp_listen") and text.isdigit():
        text = "127.0.0.1:" + text
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{name}: expected HOST:PORT, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{name}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{name}: port {port} is outside [0, 65535]")
    return host, port


# --- the sections ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ServerSettings:
    """Where the agent listens: the runtimes' socket and TCP listener, the HTTP server and its protection."""

    socket: str = setting(default_socket_path, "unix socket the runtimes connect to",
                          default_text="$RUNTIME_DIRECTORY/moewatch.sock, else /run/moewatch/moewatch.sock")
    socket_mode: str = setting("0660", "permissions of the socket file (octal)", normalize=octal_mode)
    listen: str = setting("127.0.0.1:9477", "HOST:PORT of the HTTP server (/metrics, /healthz, /readyz, /status)")
    tcp_listen: str = setting("", "HOST:PORT of an optional TCP listener speaking the socket's frames (a bare "
                                  "PORT listens on 127.0.0.1; empty: none)")
    max_http_connections: int = setting(32, "HTTP requests served at once; more are closed at once (connections "
                                            "that send nothing yet wait without a slot, at most 4 times this many)",
                                        kind=int, lo=1, hi=10_000)
    http_idle_seconds: float = setting(10.0, "an HTTP connection that sends nothing for this long is closed",
                                       kind=float, lo=0.1, hi=3600)
    tls_cert_file: str = setting("", "PEM certificate for HTTPS on server.listen (with server.tls_key_file; "
                                     "empty: plain HTTP)")
    tls_key_file: str = setting("", "PEM private key of server.tls_cert_file")
    basic_auth_user: str = setting("", "user name HTTP clients must give for /metrics and /status (empty: no "
                                       "authentication; /healthz and /readyz stay open for probes)")
    basic_auth_password_file: str = setting("", "file holding the basic-auth password (first line)")

    def __post_init__(self) -> None:
        check_section(self, "server")
        if not self.socket:
            raise ConfigError("server.socket: must not be empty")
        parse_listen(self.listen)
        if self.tcp_listen:
            host, port = parse_listen(self.tcp_listen, "server.tcp_listen")
            object.__setattr__(self, "tcp_listen", f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("server.tls_cert_file: give both server.tls_cert_file and server.tls_key_file, "
                              "or neither")
        if bool(self.basic_auth_user) != bool(self.basic_auth_password_file):
            raise ConfigError("server.basic_auth_user: give both server.basic_auth_user and "
                              "server.basic_auth_password_file, or neither")

    @property
    def socket_mode_bits(self) -> int:
        return int(self.socket_mode, 8)

    @property
    def listen_address(self) -> tuple[str, int]:
        return parse_listen(self.listen)

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        return parse_listen(self.tcp_listen, "server.tcp_listen") if self.tcp_listen else None


@dataclass(frozen=True)
class LimitsSettings:
    """What a peer may cost the agent (hostile or broken runtimes): frames, buffers, connections, hellos, groups."""

    max_frame_bytes: int = setting(16 * 1024 * 1024, "largest frame accepted; a larger one closes the connection",
                                   kind=int, lo=1024, hi=64 * 1024 * 1024)
    frame_deadline_seconds: float = setting(10.0, "a frame that started to arrive must be complete within this, "
                                                  "and a queued plan must leave within this; else the connection "
                                                  "is closed", kind=float, lo=0.01, hi=3600)
    buffer_budget_bytes: int = setting(256 * 1024 * 1024, "partial frames held across all connections; the "
                                                          "connection that would exceed it is closed", kind=int,
                                       lo=1024, hi=1 << 40)
    max_outbox_bytes: int = setting(16 * 1024 * 1024, "plan bytes queued for one runtime that does not read before "
                                                      "its connection is closed", kind=int, lo=1024, hi=1 << 34)
    max_connections: int = setting(256, "runtime connections open at once (socket and TCP); more are refused and "
                                        "counted", kind=int, lo=1, hi=1_000_000)
    hello_deadline_seconds: float = setting(10.0, "a connection that has not said hello this long after it opened "
                                                  "is closed (a silent peer keeps no connection slot)", kind=float,
                                            lo=0.01, hi=3600)
    max_world_size: int = setting(4096, "largest world_size a hello may declare", kind=int, lo=1, hi=1 << 20)
    max_num_layers: int = setting(1024, "most MoE layers a hello may declare", kind=int, lo=1, hi=1 << 20)
    max_num_experts: int = setting(8192, "most experts per layer a hello may declare", kind=int, lo=1, hi=1 << 24)
    max_num_slots: int = setting(131072, "most physical slots per layer a hello may declare", kind=int, lo=1,
                                 hi=1 << 26)
    max_groups: int = setting(64, "EP groups tracked at once; at the limit a new group evicts the one whose runtime "
                                  "left the longest ago, and a hello is refused only when every group is connected",
                              kind=int, lo=1, hi=10_000)
    group_retire_seconds: float = setting(3600.0, "a group whose runtime left and sent nothing for this long is "
                                                  "forgotten and its series removed", kind=float, lo=0.1,
                                          hi=365 * 86_400)

    # A sharded group (one process per DP rank sends a shard of each window, docs/telemetry.md): how long
    # and how many of its window sequences are held for their shards.
    shard_deadline_windows: float = setting(1.0, "a sharded group's window sequence whose shards are not all in "
                                                 "this many window lengths (its first shard's end_time - "
                                                 "start_time) after its first shard arrived is merged and triaged "
                                                 "without them, naming them missing", kind=float, lo=0.01, hi=1000)
    shard_min_deadline_seconds: float = setting(2.0, "that deadline is never shorter than this (the shards of short "
                                                     "windows still get time to cross the network)", kind=float,
                                                lo=0, hi=3600)
    max_shard_sequences: int = setting(8, "window sequences of one sharded group held for their shards at once; "
                                          "past it the oldest is merged with the shards it has", kind=int, lo=1,
                                       hi=10_000)

    def __post_init__(self) -> None:
        check_section(self, "limits")
        if self.buffer_budget_bytes < self.max_frame_bytes:
            raise ConfigError(f"limits.buffer_budget_bytes: {self.buffer_budget_bytes} is below "
                              f"limits.max_frame_bytes {self.max_frame_bytes} (one whole frame must fit)")

    def shard_deadline_seconds(self, window_seconds: float) -> float:
        """How long a sharded group's sequence of windows `window_seconds` long waits for its shards."""
        return max(self.shard_deadline_windows * max(window_seconds, 0.0), self.shard_min_deadline_seconds)


@dataclass(frozen=True)
class HistorySettings:
    """What the agent keeps per EP group."""

    windows: int = setting(64, "windows kept per EP group (a rolling history)", kind=int, lo=2, hi=100_000)
    bytes: int = setting(64 * 1024 * 1024, "most bytes of window arrays kept per EP group, history and backlog "
                         "together; the oldest go first (a 58x256 window is about 2.8 MB, its diagnosis about "
                         "0.5 MB more)", kind=int, lo=1024 * 1024, hi=1 << 40)

    def __post_init__(self) -> None:
        check_section(self, "history")


@dataclass(frozen=True)
class JobsSettings:
    """How often each scheduled job runs."""

    triage_interval_seconds: float = setting(1.0, "how often the triage job triages the windows that arrived "
                                                  "since its last run", kind=float, lo=0.05, hi=3600)
    plan_interval_seconds: float = setting(120.0, "how often the planning job runs the policy", kind=float,
                                           lo=0.1, hi=86_400)
    export_interval_seconds: float = setting(5.0, "how often the export job refreshes derived series", kind=float,
                                             lo=0.1, hi=3600)

    def __post_init__(self) -> None:
        check_section(self, "jobs")


@dataclass(frozen=True)
class ExportersSettings:
    """What is exported beyond the default series, and the OTLP push."""

    expert_metrics: bool = setting(False, "export per-expert pair counters (moewatch_expert_pairs_total)",
                                   kind=bool)
    expert_series_cap: int = setting(2000, "most per-expert series exported; the rest are counted as left out",
                                     kind=int, lo=0, hi=1_000_000)
    otlp_endpoint: str = setting("", "OTLP/HTTP metrics endpoint, e.g. http://collector:4318/v1/metrics "
                                     "(empty: no push)")
    otlp_interval_seconds: float = setting(15.0, "how often metrics are pushed over OTLP", kind=float, lo=1,
                                           hi=3600)

    def __post_init__(self) -> None:
        check_section(self, "exporters")


@dataclass(frozen=True)
class PolicySettings:
    """What the agent may do and the guardrails it decides within."""

    mode: str = setting("observe", "observe (metrics only), recommend (log and export recommendations) or act "
                                   "(send plans)", choices=MODES)
    persist_windows: int = setting(3, "consecutive windows a verdict must hold before the policy acts on it (K)",
                                   kind=int, lo=1, hi=10_000)
    horizon_seconds: float = setting(600.0, "how long a plan's predicted gain is counted for in the cost gate",
                                     kind=float, lo=1, hi=7 * 86_400)
    gain_margin: float = setting(1.0, "the gain over the horizon must exceed the predicted stall times this",
                                 kind=float, lo=0, hi=1000)
    min_balancedness_gain: float = setting(0.02, "a placement change must raise the layer's model balancedness "
                                                 "by at least this", kind=float, lo=0, hi=1)
    cooldown_seconds: float = setting(300.0, "after a change, a layer is left alone this long", kind=float,
                                      lo=0, hi=7 * 86_400)
    max_plans_per_hour: int = setting(6, "global rate limit on plans sent (rollbacks excepted)", kind=int,
                                      lo=0, hi=100_000)
    max_replicas_per_expert: int = setting(4, "most slots one expert may hold (within the runtime's fixed slots)",
                                           kind=int, lo=1, hi=100_000)
    capacity_factor_min: float = setting(1.0, "lowest capacity factor the agent may set", kind=float, lo=0.1,
                                         hi=100)
    capacity_factor_max: float = setting(2.0, "highest capacity factor the agent may set", kind=float, lo=0.1,
                                         hi=100)
    allow_lossy_capacity: bool = setting(False, "allow capping hot experts (drops pairs) to level ranks",
                                         kind=bool)
    slow_rank_windows: int = setting(3, "windows a rank's relative speed (its pairs per compute second over the "
                                        "median rank's) must stay under slow_rank_below to count as slow, or above "
                                        "slow_rank_recover_above to recover; also the span of its median",
                                     kind=int, lo=1, hi=10_000)
    slow_rank_min_seconds: float = setting(10.0, "wall seconds those slow_rank_windows windows in a row must span "
                                                 "at least, for a rank to count as slow or as recovered (a "
                                                 "slowdown shorter than this moves no weights)", kind=float, lo=0,
                                           hi=86_400)
    slow_rank_min_pairs: int = setting(1000, "a window measures a rank's speed only when the rank computed at least "
                                             "this many pairs in it (all layers)", kind=int, lo=1, hi=1 << 40)
    slow_rank_below: float = setting(0.85, "relative speed under which a rank counts as slow; plans are then made "
                                           "for the measured speeds", kind=float, lo=0.01, hi=1)
    slow_rank_recover_above: float = setting(0.95, "relative speed above which a slow rank counts as recovered "
                                                   "(plans for equal speeds again)", kind=float, lo=0.01, hi=1)
    slow_rank_replan_change: float = setting(0.25, "while a placement made for rank speeds is in force, a new one is "
                                                   "planned only when a rank's measured speed moved by more than "
                                                   "this share of the speed it was made for", kind=float, lo=0, hi=10)

    def __post_init__(self) -> None:
        check_section(self, "policy")
        if self.slow_rank_below >= self.slow_rank_recover_above:
            # Without a gap between the two a rank near the threshold would flap between plans.
            raise ConfigError(f"policy.slow_rank_below: {self.slow_rank_below:g} must be under "
                              f"policy.slow_rank_recover_above {self.slow_rank_recover_above:g}")
        if self.capacity_factor_min > self.capacity_factor_max:
            raise ConfigError(f"policy.capacity_factor_min: {self.capacity_factor_min:g} is above "
                              f"policy.capacity_factor_max {self.capacity_factor_max:g}")


@dataclass(frozen=True)
class VerifySettings:
    """How a plan is judged after its Ack, and when it is rolled back."""

    windows: int = setting(3, "windows of the new epoch compared with the windows before a change", kind=int,
                           lo=1, hi=10_000)
    rollback_balancedness_drop: float = setting(0.05, "roll back when a changed layer's balancedness falls by "
                                                      "more than this", kind=float, lo=0, hi=1)
    rollback_time_rise: float = setting(0.25, "roll back when a changed layer's time per step, for the same "
                                              "busiest-rank load, rises by more than this share", kind=float, lo=0,
                                        hi=100)
    ack_timeout_seconds: float = setting(60.0, "a plan with no Ack after this long counts as failed", kind=float,
                                         lo=0.1, hi=86_400)

    def __post_init__(self) -> None:
        check_section(self, "verify")


@dataclass(frozen=True)
class CostSettings:
    """What a plan costs: the planner cost model's inputs for moving expert weights."""

    expert_bytes: int = setting(2 * 4096 * 14336 * 3, "bytes of one expert's weights (moved when a slot changes "
                                                       "expert)", kind=int, lo=1, hi=1 << 50)
    migration_bandwidth_bytes_per_second: float = setting(5e10, "bandwidth weights move at during a rebalance",
                                                          kind=float, lo=1, hi=1e15)
    inter_node_bandwidth_bytes_per_second: float = setting(2.2e10, "bandwidth weights move at between nodes (the "
                                                                   "slower link; prices a multi-node rebalance)",
                                                           kind=float, lo=1, hi=1e15)

    def __post_init__(self) -> None:
        check_section(self, "cost")


@dataclass(frozen=True)
class LogSettings:
    """The audit log and the agent's own log."""

    audit_log: str = setting(default_audit_path, "append-only JSONL of every decision",
                             default_text="$STATE_DIRECTORY/audit.jsonl, else /var/lib/moewatch/audit.jsonl")
    level: str = setting("info", "log verbosity", choices=LOG_LEVELS)
    interval_seconds: float = setting(60.0, "repeated lines (rejected frames, refused connections, runtimes "
                                            "connecting and leaving, skipped jobs) are logged at most once per "
                                            "reason per interval", kind=float,
                                      lo=0.01, hi=86_400)

    def __post_init__(self) -> None:
        check_section(self, "log")


AGENT_SECTIONS: dict[str, type] = {"server": ServerSettings, "limits": LimitsSettings, "history": HistorySettings,
                                   "jobs": JobsSettings, "exporters": ExportersSettings, "policy": PolicySettings,
                                   "verify": VerifySettings, "cost": CostSettings, "log": LogSettings}


def engine_sections() -> dict[str, type]:
    """Each engine's section, by name, as its integration declares it (the agent reads it as `cfg.<engine>`)."""
    return registry.settings_sections()


def sections() -> dict[str, type]:
    """Every section but the thresholds, in the order docs and the sample file show them."""
    return {**AGENT_SECTIONS, **engine_sections()}


@dataclass(frozen=True)
class AgentConfig:
    server: ServerSettings = field(default_factory=ServerSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    history: HistorySettings = field(default_factory=HistorySettings)
    jobs: JobsSettings = field(default_factory=JobsSettings)
    exporters: ExportersSettings = field(default_factory=ExportersSettings)
    policy: PolicySettings = field(default_factory=PolicySettings)
    verify: VerifySettings = field(default_factory=VerifySettings)
    cost: CostSettings = field(default_factory=CostSettings)
    log: LogSettings = field(default_factory=LogSettings)
    thresholds: Thresholds = field(default_factory=Thresholds)
    # {engine name: its settings}; each is also `cfg.<name>`. Missing engines get their defaults.
    engines: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, cls in AGENT_SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name}: expected a {cls.__name__}")
        if not isinstance(self.thresholds, Thresholds):
            raise ConfigError("thresholds: expected a mapping of threshold names to numbers")
        engines = dict(self.engines)
        for name, cls in engine_sections().items():
            engines.setdefault(name, cls())
            if not isinstance(engines[name], cls):
                raise ConfigError(f"{name}: expected a {cls.__name__}")
        unknown = sorted(set(engines) - set(engine_sections()))
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown section")
        object.__setattr__(self, "engines", MappingProxyType(engines))

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: an engine section by its name (cfg.sglang).
        engines = self.__dict__.get("engines")
        if engines is not None and name in engines:
            return engines[name]
        raise AttributeError(name)

    def section(self, name: str) -> Any:
        return getattr(self, name)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None = None, **overrides: Mapping[str, Any]) -> "AgentConfig":
        """A config from {section: {field: value}} (or {"section.field": value}) over the defaults, each
        keyword section's settings laid over `data`'s: from_mapping(base, policy={"mode": "act"}). For tests
        and tools; the environment is not read."""
        merged: dict[str, Any] = {}
        for key, value in [*(data or {}).items(), *overrides.items()]:
            if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
                value = {**merged[key], **value}
            merged[key] = value
        values: dict[tuple[str, str], Any] = {}
        for key, value in merged.items():
            section, _, name = str(key).partition(".")
            if section not in sections() and section != THRESHOLDS:
                raise ConfigError(_unknown(section, section))
            items = {name: value} if name else value
            if not isinstance(items, Mapping):
                raise ConfigError(f"{section}: expected a mapping of settings")
            values.update(_read_section(section, items, lambda s, n: f"{s}.{n}"))
        return _assemble(values)

    def to_dict(self) -> dict[str, Any]:
        out = {name: dataclasses.asdict(self.section(name)) for name in sections()}
        out[THRESHOLDS] = dataclasses.asdict(self.thresholds)
        return out


# --- names ----------------------------------------------------------------------------------------

def env_name(section: str, name: str) -> str:
    return f"{ENV_PREFIX}{section.upper()}__{name.upper()}"


def flag_name(section: str, name: str) -> str:
    return f"--{section}.{name.replace('_', '-')}"


def flag_dest(section: str, name: str) -> str:
    """The click parameter name of a sectioned flag."""
    return f"{section}__{name}"


def threshold_names() -> list[str]:
    return [f.name for f in dataclasses.fields(Thresholds)]


def _all_paths() -> list[tuple[str, str]]:
    paths = [(s, n) for s, cls in sections().items() for n in section_fields(cls)]
    return paths + [(THRESHOLDS, n) for n in threshold_names()]


# The flat names before sections: each agent section's and threshold's field kept its name, but for
# these; an engine's are its integration's to declare (Integration.flat_names).
_RENAMED = {"history_windows": ("history", "windows"), "history_bytes": ("history", "bytes"),
            "verify_windows": ("verify", "windows"), "log_level": ("log", "level"),
            "log_interval_seconds": ("log", "interval_seconds")}


def moved_settings() -> dict[str, tuple[str, str]]:
    """{old flat name: (section, field)} for every setting of the flat namespace."""
    out: dict[str, tuple[str, str]] = {}
    for section, name in _all_paths():
        if section not in engine_sections() and (section, name) not in _RENAMED.values():
            out[name] = (section, name)
    for integration in registry.integrations():
        out.update({old: (integration.settings_section, name) for old, name in integration.flat_names.items()})
    out.update(_RENAMED)
    return out


# --- sources --------------------------------------------------------------------------------------

def _read_section(section: str, items: Mapping[str, Any], where: Callable[[str, str], str]
                  ) -> dict[tuple[str, str], Any]:
    """One section's values from a source, each coerced alone so an error names where it came from."""
    out: dict[tuple[str, str], Any] = {}
    if section == THRESHOLDS:
        for key, value in items.items():
            name = str(key).replace("-", "_")
            out[(section, name)] = _threshold(name, value, where(section, name))
        return out
    cls = sections().get(section)
    if cls is None:
        raise ConfigError(_unknown(section, section))
    known = section_fields(cls)
    for key, value in items.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ConfigError(f"{where(section, name)}: unknown setting")
        out[(section, name)] = coerce(known[name], value, where(section, name))
    return out


def _threshold(name: str, value: Any, where: str) -> float:
    if name not in threshold_names():
        raise ConfigError(f"{where}: unknown threshold (known: {', '.join(sorted(threshold_names()))})")
    try:
        number = float(value) if isinstance(value, str) else value
        Thresholds.from_mapping({name: number})
    except ConfigError as exc:
        raise ConfigError(f"{where}: {str(exc).split(': ', 1)[1]}") from None
    except ValueError:
        raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    return number


def _unknown(key: str, where: str) -> str:
    moved = moved_settings().get(key)
    if moved is not None:
        return f"{where}: moved to {'.'.join(moved)}"
    return f"{where}: unknown section"


def load_yaml(path: str | Path) -> dict[tuple[str, str], Any]:
    """The YAML file's settings, {(section, field): value}; a flat key of old is refused with its new place."""
    data = read_yaml_mapping(path, "a mapping of sections")
    out: dict[tuple[str, str], Any] = {}
    for key, items in data.items():
        section = str(key)
        if section not in sections() and section != THRESHOLDS:
            raise ConfigError(_unknown(section, f"{path}: {section}"))
        if items is None:
            continue
        if not isinstance(items, Mapping):
            what = "threshold names to numbers" if section == THRESHOLDS else "settings"
            raise ConfigError(f"{path}: {section}: expected a mapping of {what}")
        out.update(_read_section(section, items, lambda s, n: f"{path}: {s}.{n}"))
    return out


def load_env(environ: Mapping[str, str]) -> dict[tuple[str, str], Any]:
    """MOEWATCH_<SECTION>__<FIELD> variables. A variable of the flat namespace before sections is refused
    with its new name; other MOEWATCH_* variables (the runtime's own) are left alone."""
    by_env = {env_name(s, n): (s, n) for s, n in _all_paths()}
    prefixes = {env_name(s, "") for s in [*sections(), THRESHOLDS]}
    old = {ENV_PREFIX + name.upper(): path for name, path in moved_settings().items()}
    out: dict[tuple[str, str], Any] = {}
    for variable in sorted(environ):
        if variable in by_env:
            section, name = by_env[variable]
            out.update(_read_section(section, {name: environ[variable]}, lambda s, n: variable))
        elif variable in old:
            raise ConfigError(f"{variable}: moved to {env_name(*old[variable])}")
        elif any(variable.startswith(prefix) for prefix in prefixes):
            raise ConfigError(f"{variable}: unknown setting")
    return out


def load_flags(flags: Mapping[str, Any]) -> dict[tuple[str, str], Any]:
    """{"section.field" or "section__field": value} flags; None means not given."""
    out: dict[tuple[str, str], Any] = {}
    for key, value in flags.items():
        if value is None:
            continue
        section, sep, name = str(key).replace("__", ".", 1).partition(".")
        if not sep:
            moved = moved_settings().get(section.replace("-", "_"))
            flag = "--" + section.replace("_", "-")
            raise ConfigError(f"{flag}: moved to {flag_name(*moved)}" if moved else f"{flag}: unknown setting")
        name = name.replace("-", "_")
        out.update(_read_section(section, {name: value}, flag_name))
    return out


def _assemble(values: Mapping[tuple[str, str], Any]) -> AgentConfig:
    by_section: dict[str, dict[str, Any]] = {}
    for (section, name), value in values.items():
        by_section.setdefault(section, {})[name] = value
    built = {name: cls(**by_section.get(name, {})) for name, cls in AGENT_SECTIONS.items()}
    engines = {name: cls(**by_section.get(name, {})) for name, cls in engine_sections().items()}
    return AgentConfig(**built, thresholds=Thresholds.from_mapping(by_section.get(THRESHOLDS, {})), engines=engines)


def build_config(config_path: str | None = None, environ: Mapping[str, str] | None = None,
                 flags: Mapping[str, Any] | None = None) -> AgentConfig:
    """Defaults < YAML < environment < flags, checked once. Flags whose value is None were not given."""
    environ = os.environ if environ is None else environ
    merged = {**(load_yaml(config_path) if config_path else {}), **load_env(environ), **load_flags(flags or {})}
    return _assemble(merged)


# --- what the schema generates: docs, the sample file, the flags ---------------------------------

def describe() -> list[dict[str, Any]]:
    """Every setting with its path, flag, variable, default and meaning (docs/agent.md is generated from it)."""
    aliases = {path: flag for flag, path in FLAG_ALIASES.items()}
    rows = []
    for section, cls in sections().items():
        for name, f in section_fields(cls).items():
            meta = f.metadata
            path = f"{section}.{name}"
            rows.append({"name": path, "section": section, "field": name, "flag": flag_name(section, name),
                         "alias": aliases.get(path, ""), "env": env_name(section, name),
                         "type": meta["kind"].__name__, "default": default_of(f), "help": meta["help"],
                         "choices": list(meta["choices"])})
    for row in Thresholds.describe():
        rows.append({"name": f"{THRESHOLDS}.{row['name']}", "section": THRESHOLDS, "field": row["name"],
                     "flag": flag_name(THRESHOLDS, row["name"]), "alias": "",
                     "env": env_name(THRESHOLDS, row["name"]), "type": "float", "default": row["default"],
                     "help": row["help"], "choices": []})
    return rows


def _section_doc(section: str) -> str:
    if section == THRESHOLDS:
        return "The triage thresholds (moewatch diagnose's); docs/triage.md gives their sources."
    return " ".join((sections()[section].__doc__ or "").split())


def settings_table() -> str:
    """The Markdown of docs/agent.md's settings, one table per section."""
    lines: list[str] = []
    for section in [*sections(), THRESHOLDS]:
        lines += [f"#### `{section}`", "", _section_doc(section), "",
                  "| setting | flag | variable | type | default | meaning |", "|---|---|---|---|---|---|"]
        for row in (r for r in describe() if r["section"] == section):
            flag = f"`{row['flag']}`" + (f" (`{row['alias']}`)" if row["alias"] else "")
            default = row["default"]
            default = '""' if default == "" else f"{default:g}" if isinstance(default, float) else str(default)
            choices = " \\| ".join(row["choices"])
            meaning = row["help"] + (f" ({choices})" if choices else "")
            lines.append(f"| `{row['field']}` | {flag} | `{row['env']}` | {row['type']} | {default} | {meaning} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def sample_config() -> str:
    """agent/deploy/agent.yaml: every section and setting at its default, each with its meaning. A default
    worked out at start (the socket and audit paths under systemd) is left commented out."""
    out = ["# /etc/moewatch/agent.yaml: the agent's configuration, one mapping per section. Generated from the",
           "# schema (scripts/config_docs.py); docs/agent.md lists every setting with its flag and MOEWATCH_*",
           "# variable. Anything left out keeps its default."]
    for section in [*sections(), THRESHOLDS]:
        out += ["", *(f"# {line}" for line in textwrap.wrap(_section_doc(section), 100)), f"{section}:"]
        rows = [r for r in describe() if r["section"] == section]
        for row in rows:
            out += [f"  # {line}" for line in textwrap.wrap(row["help"], 98)]
            factory = section in sections() and section_fields(sections()[section])[row["field"]].default is \
                dataclasses.MISSING
            text = yaml.safe_dump({row["field"]: row["default"]}, default_flow_style=False, width=1000).strip()
            if factory:
                value = section_fields(sections()[section])[row["field"]].default_factory()
                text = "# " + yaml.safe_dump({row["field"]: _systemd_default(value)}, width=1000).strip()
            out.append(f"  {text}")
    return "\n".join(out) + "\n"


def _systemd_default(value: str) -> str:
    # The sample shows the path the agent picks without RUNTIME_DIRECTORY / STATE_DIRECTORY.
    return "/run/moewatch/moewatch.sock" if value.endswith(".sock") else "/var/lib/moewatch/audit.jsonl"


def config_options(command: Callable) -> Callable:
    """One click option per setting, `--section.field` (default None = not given), with the documented
    aliases; the flat flags before sections are accepted only to be refused with the flag they moved to."""
    import click

    for row in reversed(describe()):
        section, name = row["section"], row["field"]
        decls = [row["flag"]] + ([row["alias"]] if row["alias"] else [])
        if row["type"] == "bool":
            negative = f"--{section}.no-{name.replace('_', '-')}"
            opt = click.option(f"{row['flag']}/{negative}", flag_dest(section, name), default=None, help=row["help"])
        else:
            ctype = {"int": int, "float": float}.get(row["type"], str)
            if row["choices"]:
                ctype = click.Choice(row["choices"])
            opt = click.option(*decls, flag_dest(section, name), type=ctype, default=None, help=row["help"],
                               metavar=None if row["choices"] else row["type"].upper())
        command = opt(command)
    for old, path in sorted(moved_settings().items()):
        if "--" + old.replace("_", "-") in FLAG_ALIASES:
            continue  # the alias is the same setting
        command = _refused_flag(old, path)(command)
    return command


def _refused_flag(old: str, path: tuple[str, str]) -> Callable:
    import click

    new = flag_name(*path)
    flags = ["--" + old.replace("_", "-")]
    kind = (section_fields(sections()[path[0]])[path[1]].metadata["kind"] if path[0] in sections() else float)
    if kind is bool:
        flags.append("--no-" + old.replace("_", "-"))

    def refuse(ctx, param, value):
        if value:
            raise click.UsageError(f"{flags[0]}: moved to {new}")
        return value

    if kind is bool:
        return click.option(*flags, hidden=True, is_flag=True, default=None, expose_value=False, callback=refuse)
    return click.option(flags[0], hidden=True, default=None, expose_value=False, callback=refuse)

