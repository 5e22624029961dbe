"""The agent's configuration: one validated object, from a YAML file, MOEWATCH_* variables and flags.

Precedence, lowest first: built-in defaults, the YAML file (`--config`), environment variables
(`MOEWATCH_<FIELD>`), command-line flags (`--<field>`). The triage thresholds sit in the same file
under `thresholds:` and, like every agent field, are also a flag (`--comm-share`) and a variable
(`MOEWATCH_COMM_SHARE`). Everything is checked once, at start: a bad value stops the agent with an
error that names the field and where the value came from (`MOEWATCH_MODE: ...`, `--listen: ...`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from moewatch.thresholds import ConfigError, Thresholds, read_yaml_mapping

MODES = ("observe", "recommend", "act")
ACTUATORS = ("runtime", "sglang")
LOG_LEVELS = ("debug", "info", "warning", "error")
ENV_PREFIX = "MOEWATCH_"


def default_socket_path() -> str:
    # systemd's RuntimeDirectory= exports RUNTIME_DIRECTORY (colon-separated when there are several).
    base = (os.environ.get("RUNTIME_DIRECTORY") or "").split(":")[0] or "/run/moewatch"
    return str(Path(base) / "moewatch.sock")


def default_audit_path() -> str:
    base = (os.environ.get("STATE_DIRECTORY") or "").split(":")[0] or "/var/lib/moewatch"
    return str(Path(base) / "audit.jsonl")


def _f(default: Any, help: str, *, kind: type = str, lo: float | None = None, hi: float | None = None,
       choices: tuple[str, ...] = (), default_text: str | None = None) -> Any:
    meta = {"help": help, "kind": kind, "lo": lo, "hi": hi, "choices": choices, "default_text": default_text}
    if callable(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class AgentConfig:
    # --- where it listens
    socket: str = _f(default_socket_path, "unix socket the runtimes connect to",
                     default_text="$RUNTIME_DIRECTORY/moewatch.sock, else /run/moewatch/moewatch.sock")
    socket_mode: str = _f("0660", "permissions of the socket file (octal)")
    listen: str = _f("127.0.0.1:9477", "HOST:PORT of the HTTP server (/metrics, /healthz, /readyz, /status)")
    max_frame_bytes: int = _f(16 * 1024 * 1024, "largest frame accepted; a larger one closes the connection",
                              kind=int, lo=1024, hi=64 * 1024 * 1024)
    tcp_listen: str = _f("", "HOST:PORT of an optional TCP listener speaking the socket's frames (a bare PORT "
                             "listens on 127.0.0.1; empty: none)")
    # --- what a peer may cost (hostile or broken runtimes)
    max_connections: int = _f(256, "runtime connections open at once (socket and TCP); more are refused and "
                                   "counted", kind=int, lo=1, hi=1_000_000)
    hello_deadline_seconds: float = _f(10.0, "a connection that has not said hello this long after it opened is "
                                             "closed (a silent peer keeps no connection slot)", kind=float,
                                       lo=0.01, hi=3600)
    frame_deadline_seconds: float = _f(10.0, "a frame that started to arrive must be complete within this, and a "
                                             "queued plan must leave within this; else the connection is closed",
                                       kind=float, lo=0.01, hi=3600)
    buffer_budget_bytes: int = _f(256 * 1024 * 1024, "partial frames held across all connections; the connection "
                                                     "that would exceed it is closed", kind=int, lo=1024,
                                  hi=1 << 40)
    max_outbox_bytes: int = _f(16 * 1024 * 1024, "plan bytes queued for one runtime that does not read before "
                                                 "its connection is closed", kind=int, lo=1024, hi=1 << 34)
    max_world_size: int = _f(4096, "largest world_size a hello may declare", kind=int, lo=1, hi=1 << 20)
    max_num_layers: int = _f(1024, "most MoE layers a hello may declare", kind=int, lo=1, hi=1 << 20)
    max_num_experts: int = _f(8192, "most experts per layer a hello may declare", kind=int, lo=1, hi=1 << 24)
    max_num_slots: int = _f(131072, "most physical slots per layer a hello may declare", kind=int, lo=1,
                            hi=1 << 26)
    group_retire_seconds: float = _f(3600.0, "a group whose runtime left and sent nothing for this long is "
                                             "forgotten and its series removed", kind=float, lo=0.1,
                                     hi=365 * 86_400)
    log_interval_seconds: float = _f(60.0, "repeated warnings (rejected frames, refused connections, skipped "
                                           "jobs) are logged at most once per reason per interval", kind=float,
                                     lo=0.01, hi=86_400)
    # --- the HTTP listener's protection
    max_http_connections: int = _f(32, "HTTP requests served at once; more are closed at once (connections that "
                                       "send nothing yet wait without a slot, at most 4 times this many)", kind=int,
                                   lo=1, hi=10_000)
    http_idle_seconds: float = _f(10.0, "an HTTP connection that sends nothing for this long is closed",
                                  kind=float, lo=0.1, hi=3600)
    tls_cert_file: str = _f("", "PEM certificate for HTTPS on `listen` (with tls_key_file; empty: plain HTTP)")
    tls_key_file: str = _f("", "PEM private key of tls_cert_file")
    basic_auth_user: str = _f("", "user name HTTP clients must give for /metrics and /status (empty: no "
                                  "authentication; /healthz and /readyz stay open for probes)")
    basic_auth_password_file: str = _f("", "file holding the basic-auth password (first line)")
    # --- what it keeps
    history_windows: int = _f(64, "windows kept per EP group (a rolling history)", kind=int, lo=2, hi=100_000)
    history_bytes: int = _f(64 * 1024 * 1024, "most bytes of window arrays kept per EP group, history and "
                            "backlog together; the oldest go first (a 58x256 window is about 2.8 MB, its diagnosis "
                            "about 0.5 MB more)",
                            kind=int, lo=1024 * 1024, hi=1 << 40)
    max_groups: int = _f(64, "EP groups tracked at once; at the limit a new group evicts the one whose runtime "
                             "left the longest ago, and a hello is refused only when every group is connected",
                         kind=int, lo=1, hi=10_000)
    # --- the jobs
    triage_interval_seconds: float = _f(1.0, "how often the triage job triages the windows that arrived "
                                             "since its last run", kind=float, lo=0.05, hi=3600)
    plan_interval_seconds: float = _f(120.0, "how often the planning job runs the policy", kind=float,
                                      lo=0.1, hi=86_400)
    export_interval_seconds: float = _f(5.0, "how often the export job refreshes derived series", kind=float,
                                        lo=0.1, hi=3600)
    # --- export
    expert_metrics: bool = _f(False, "export per-expert pair counters (moewatch_expert_pairs_total)", kind=bool)
    expert_series_cap: int = _f(2000, "most per-expert series exported; the rest are counted as left out",
                                kind=int, lo=0, hi=1_000_000)
    otlp_endpoint: str = _f("", "OTLP/HTTP metrics endpoint, e.g. http://collector:4318/v1/metrics "
                                "(empty: no push)")
    otlp_interval_seconds: float = _f(15.0, "how often metrics are pushed over OTLP", kind=float, lo=1, hi=3600)
    # --- policy
    mode: str = _f("observe", "observe (metrics only), recommend (log and export recommendations) or act "
                              "(send plans)", choices=MODES)
    persist_windows: int = _f(3, "consecutive windows a verdict must hold before the policy acts on it (K)",
                              kind=int, lo=1, hi=10_000)
    horizon_seconds: float = _f(600.0, "how long a plan's predicted gain is counted for in the cost gate",
                                kind=float, lo=1, hi=7 * 86_400)
    gain_margin: float = _f(1.0, "the gain over the horizon must exceed the predicted stall times this",
                            kind=float, lo=0, hi=1000)
    min_balancedness_gain: float = _f(0.02, "a placement change must raise the layer's model balancedness by at "
                                            "least this", kind=float, lo=0, hi=1)
    cooldown_seconds: float = _f(300.0, "after a change, a layer is left alone this long", kind=float,
                                 lo=0, hi=7 * 86_400)
    max_plans_per_hour: int = _f(6, "global rate limit on plans sent (rollbacks excepted)", kind=int,
                                 lo=0, hi=100_000)
    max_replicas_per_expert: int = _f(4, "most slots one expert may hold (within the runtime's fixed slots)",
                                      kind=int, lo=1, hi=100_000)
    capacity_factor_min: float = _f(1.0, "lowest capacity factor the agent may set", kind=float, lo=0.1, hi=100)
    capacity_factor_max: float = _f(2.0, "highest capacity factor the agent may set", kind=float, lo=0.1, hi=100)
    allow_lossy_capacity: bool = _f(False, "allow capping hot experts (drops pairs) to level ranks", kind=bool)
    verify_windows: int = _f(3, "windows of the new epoch compared with the windows before a change",
                             kind=int, lo=1, hi=10_000)
    rollback_balancedness_drop: float = _f(0.05, "roll back when a changed layer's balancedness falls by more "
                                                 "than this", kind=float, lo=0, hi=1)
    rollback_time_rise: float = _f(0.25, "roll back when a changed layer's time per step, for the same "
                                         "busiest-rank load, rises by more than this share", kind=float, lo=0, hi=100)
    ack_timeout_seconds: float = _f(60.0, "a plan with no Ack after this long counts as failed", kind=float,
                                    lo=0.1, hi=86_400)
    # --- what a plan costs (planner cost model inputs)
    expert_bytes: int = _f(2 * 4096 * 14336 * 3, "bytes of one expert's weights (moved when a slot changes "
                                                  "expert)", kind=int, lo=1, hi=1 << 50)
    migration_bandwidth_bytes_per_second: float = _f(5e10, "bandwidth weights move at during a rebalance",
                                                     kind=float, lo=1, hi=1e15)
    inter_node_bandwidth_bytes_per_second: float = _f(2.2e10, "bandwidth weights move at between nodes (the "
                                                              "slower link; prices a multi-node rebalance)",
                                                      kind=float, lo=1, hi=1e15)
    # --- actuator
    actuator: str = _f("runtime", "runtime (plans over the socket) or sglang (an --init-expert-location file)",
                       choices=ACTUATORS)
    sglang_location_file: str = _f("", "where the sglang actuator writes the expert-location JSON")
    sglang_command: str = _f("", "command run after writing the file (e.g. a rolling restart); empty: none")
    sglang_command_timeout_seconds: float = _f(600.0, "the sglang command is stopped after this long",
                                               kind=float, lo=1, hi=86_400)
    sglang_apply_seconds: float = _f(1.8, "what applying a placement costs SGLang, in seconds of stalled serving "
                                          "(about 1.8 s for its rebalance; a restart's time when sglang_command "
                                          "restarts it): the cost gate weighs every plan against it",
                                     kind=float, lo=0, hi=86_400)
    # --- SGLang as a window source (observe and recommend without a probe in SGLang)
    sglang_dump_dir: str = _f("", "SGLang's SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR: each new expert-distribution "
                                  "dump becomes one window (empty: not watched)")
    sglang_metrics_url: str = _f("", "SGLang's /metrics URL: sglang:eplb_gpu_physical_count is scraped into windows "
                                     "of per-rank load per layer, one per pair of scrapes; needs sglang_placement_file "
                                     "or sglang_num_experts (empty: not scraped)")
    sglang_poll_seconds: float = _f(15.0, "how often the SGLang dump folder is checked and /metrics scraped",
                                    kind=float, lo=0.1, hi=86_400)
    sglang_placement_file: str = _f("", "the --init-expert-location JSON SGLang was started with: the placement of the "
                                        "/metrics windows (read at each window; empty: see sglang_num_experts)")
    sglang_num_experts: int = _f(0, "logical experts per layer, for SGLang's default placement (slot s holds expert "
                                    "s; no redundant experts) when sglang_placement_file is empty (0: unknown)",
                                 kind=int, lo=0, hi=1 << 20)
    sglang_model: str = _f("sglang", "model name of the windows read from SGLang (a metric label)")
    sglang_ep_group: str = _f("ep0", "EP group name of the windows read from SGLang (a metric label)")
    # --- files and logs
    audit_log: str = _f(default_audit_path, "append-only JSONL of every decision",
                        default_text="$STATE_DIRECTORY/audit.jsonl, else /var/lib/moewatch/audit.jsonl")
    log_level: str = _f("info", "log verbosity", choices=LOG_LEVELS)
    thresholds: Thresholds = field(default_factory=Thresholds,
                                   metadata={"help": "triage thresholds (moewatch diagnose's)", "kind": Thresholds})

    def __post_init__(self) -> None:
        for f in agent_fields():
            object.__setattr__(self, f.name, _coerce(f, getattr(self, f.name)))
        host, port = parse_listen(self.listen)
        if self.capacity_factor_min > self.capacity_factor_max:
            raise ConfigError(f"capacity_factor_min: {self.capacity_factor_min:g} is above capacity_factor_max "
                              f"{self.capacity_factor_max:g}")
        if not isinstance(self.thresholds, Thresholds):
            raise ConfigError("thresholds: expected a mapping of threshold names to numbers")
        if not self.socket:
            raise ConfigError("socket: must not be empty")
        if self.tcp_listen:
            host, port = parse_listen(self.tcp_listen, "tcp_listen")
            object.__setattr__(self, "tcp_listen", f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        if self.buffer_budget_bytes < self.max_frame_bytes:
            raise ConfigError(f"buffer_budget_bytes: {self.buffer_budget_bytes} is below max_frame_bytes "
                              f"{self.max_frame_bytes} (one whole frame must fit)")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_cert_file: give both tls_cert_file and tls_key_file, or neither")
        if bool(self.basic_auth_user) != bool(self.basic_auth_password_file):
            raise ConfigError("basic_auth_user: give both basic_auth_user and basic_auth_password_file, or neither")
        if self.actuator == "sglang" and not self.sglang_location_file:
            raise ConfigError("sglang_location_file: required when actuator is sglang")
        if self.sglang_metrics_url:
            parsed = urllib.parse.urlsplit(self.sglang_metrics_url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ConfigError(f"sglang_metrics_url: expected http://HOST:PORT/metrics, got {self.sglang_metrics_url!r}")
            if not self.sglang_placement_file and not self.sglang_num_experts:
                # The exposition says nothing of the placement, and a window must state it.
                raise ConfigError("sglang_metrics_url: its windows need the placement in force: set "
                                  "sglang_placement_file (the --init-expert-location file) or sglang_num_experts "
                                  "(SGLang's default placement)")

    @property
    def socket_mode_bits(self) -> int:
        return int(self.socket_mode, 8)

    @property
    def listen_address(self) -> tuple[str, int]:
        return parse_listen(self.listen)

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        return parse_listen(self.tcp_listen, "tcp_listen") if self.tcp_listen else None

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in agent_fields()}
        out["thresholds"] = dataclasses.asdict(self.thresholds)
        return out


def agent_fields() -> list[dataclasses.Field]:
    """Every field but the nested thresholds."""
    return [f for f in dataclasses.fields(AgentConfig) if f.name != "thresholds"]


def threshold_names() -> list[str]:
    return [f.name for f in dataclasses.fields(Thresholds)]


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def parse_listen(value: str, name: str = "listen") -> tuple[str, int]:
    """'HOST:PORT' (IPv6 as [::1]:PORT) -> (host, port); raises ConfigError naming the field. For
    tcp_listen a bare PORT means loopback: another address is only ever listened on when named."""
    text = str(value).strip()
    if name == "tcp_listen" and text.isdigit():
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


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    """Check and convert one field's value; ConfigError names the field."""
    meta = f.metadata
    kind, name = meta["kind"], f.name
    if kind is bool:
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false, got {value!r}")
        return value
    if kind in (int, float):
        if isinstance(value, str):
            try:
                value = float(value.strip()) if kind is float else int(value.strip(), 0)
            except ValueError:
                raise ConfigError(f"{name}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ConfigError(f"{name}: expected a whole number, got {value!r}")
            value = int(value)
        else:
            value = float(value)
            if not math.isfinite(value):
                raise ConfigError(f"{name}: must be finite, got {value!r}")
        lo, hi = meta["lo"], meta["hi"]
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ConfigError(f"{name}: {value!r} is outside [{lo:g}, {hi:g}]")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    value = value.strip()
    if meta["choices"] and value not in meta["choices"]:
        raise ConfigError(f"{name}: {value!r} is not one of {', '.join(meta['choices'])}")
    if name == "socket_mode":
        try:
            bits = int(value, 8)
        except ValueError:
            raise ConfigError(f"socket_mode: {value!r} is not an octal mode like 0660") from None
        if not 0 <= bits <= 0o777:
            raise ConfigError(f"socket_mode: {value!r} is outside 0000-0777")
        return f"{bits:04o}"
    return value


def _from_source(raw: Mapping[str, Any], where: Callable[[str], str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a flat {field: value} mapping into agent fields and thresholds, checking each value
    alone so an error names where it came from (`where(field)`)."""
    agent_names = {f.name: f for f in agent_fields()}
    thresholds_known = set(threshold_names())
    agent, thresholds = {}, {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name in agent_names:
            try:
                agent[name] = _coerce(agent_names[name], value)
            except ConfigError as exc:
                raise ConfigError(f"{where(name)}: {str(exc).split(': ', 1)[1]}") from None
        elif name in thresholds_known:
            thresholds[name] = value
        else:
            raise ConfigError(f"{where(name)}: unknown setting")
    return agent, thresholds


def load_yaml(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The YAML file's agent fields and thresholds (both checked by name)."""
    data = read_yaml_mapping(path, "a mapping of settings")
    nested = data.pop("thresholds", None) or {}
    if not isinstance(nested, dict):
        raise ConfigError(f"{path}: thresholds: expected a mapping of threshold names to numbers")
    agent, flat_thresholds = _from_source(data, lambda name: f"{path}: {name}")
    if flat_thresholds:
        name = next(iter(flat_thresholds))
        raise ConfigError(f"{path}: {name}: a threshold belongs under `thresholds:`")
    return agent, {str(k).replace("-", "_"): v for k, v in nested.items()}


def load_env(environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """MOEWATCH_<FIELD> variables for every agent field and threshold (others are ignored)."""
    known = [f.name for f in agent_fields()] + threshold_names()
    raw = {name: environ[env_name(name)] for name in known if env_name(name) in environ}
    return _from_source(raw, env_name)


def build_config(config_path: str | None = None, environ: Mapping[str, str] | None = None,
                 flags: Mapping[str, Any] | None = None) -> AgentConfig:
    """Defaults < YAML < environment < flags. Flags whose value is None were not given."""
    environ = os.environ if environ is None else environ
    file_agent, file_thr = load_yaml(config_path) if config_path else ({}, {})
    env_agent, env_thr = load_env(environ)
    flag_agent, flag_thr = _from_source({k: v for k, v in (flags or {}).items() if v is not None}, flag_name)
    merged_thr: dict[str, Any] = {}
    for source, where in ((file_thr, lambda n: f"{config_path}: thresholds.{n}"), (env_thr, env_name),
                          (flag_thr, flag_name)):
        for name, value in source.items():
            # A threshold from a string source (env) is parsed here so its error names the variable.
            try:
                Thresholds.from_mapping({name: float(value) if isinstance(value, str) else value})
            except ConfigError as exc:
                raise ConfigError(f"{where(name)}: {str(exc).split(': ', 1)[1]}") from None
            except ValueError:
                raise ConfigError(f"{where(name)}: expected a number, got {value!r}") from None
            merged_thr[name] = float(value) if isinstance(value, str) else value
    merged = {**file_agent, **env_agent, **flag_agent}
    try:
        thresholds = Thresholds.from_mapping(merged_thr)
        return AgentConfig(**merged, thresholds=thresholds)
    except ConfigError:
        raise
    except TypeError as exc:  # pragma: no cover - guarded by _from_source
        raise ConfigError(str(exc)) from None


def describe() -> list[dict[str, Any]]:
    """Every setting with its flag, variable, default and meaning (docs/agent.md is checked against it)."""
    rows = []
    for f in agent_fields():
        meta = f.metadata
        default = meta["default_text"] or (f.default if f.default is not dataclasses.MISSING else None)
        rows.append({"name": f.name, "flag": flag_name(f.name), "env": env_name(f.name),
                     "type": meta["kind"].__name__, "default": default, "help": meta["help"],
                     "choices": list(meta["choices"])})
    for row in Thresholds.describe():
        rows.append({"name": f"thresholds.{row['name']}", "flag": flag_name(row["name"]),
                     "env": env_name(row["name"]), "type": "float", "default": row["default"],
                     "help": row["help"], "choices": []})
    return rows


def config_options(command: Callable) -> Callable:
    """One click option per agent field (default None = not given); thresholds come from
    moewatch.thresholds.thresholds_options."""
    import click

    for f in reversed(agent_fields()):
        meta = f.metadata
        if meta["kind"] is bool:
            opt = click.option(f"{flag_name(f.name)}/--no-{f.name.replace('_', '-')}", f.name, default=None,
                               help=meta["help"])
        else:
            ctype = {int: int, float: float}.get(meta["kind"], str)
            if meta["choices"]:
                ctype = click.Choice(meta["choices"])
            opt = click.option(flag_name(f.name), f.name, type=ctype, default=None, help=meta["help"],
                               metavar=None if meta["choices"] else meta["kind"].__name__.upper())
        command = opt(command)
    return command
