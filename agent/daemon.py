"""The agent process: wires config, receiver, store, jobs, exporters, policy, actuator, audit, health.

Start order: audit log, metric state (+ OpenTelemetry), store and controller, socket, HTTP, jobs,
then READY=1. Stop order (SIGTERM or SIGINT): STOPPING=1, socket (no new windows), jobs
(shutdown(wait=True): a running triage or plan finishes), applies (up to ACTUATION_STOP_SECONDS for
one running; what is left is audited as actuation_unfinished), the Ack thread, HTTP, OpenTelemetry
(final push), audit log (fsync). Every per-message path is here; per-window work runs in the triage
job, applies on the actuation worker's threads, Acks and apply outcomes on the Ack thread.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import queue
import signal
import threading
import time
from typing import Any, Callable, Iterable

from moewatch import __version__, checks
from moewatch import telemetry as tm
from moewatch.engine_rebalancing import RebalancingSettings
from moewatch.errors import InputError
from moewatch.integrations import registry
from moewatch.integrations.base import Source
from moewatch.plan import Plan
from moewatch.planner import mending_compiled
from moewatch.telemetry import Window
from moewatch.triage import diagnose
from moewatch.wire import Ack, Heartbeat, Hello

from . import engine_rebalance, rebalance_watchdog
from .ledger import RebalanceLedgers
from .actuation import ActuationWorker
from .audit import AuditLog, jsonable
from .config import AgentConfig
from .controller import Controller
from .exporters import make_registry, render
from .metrics import engine_rebalance as engine_rebalance_metrics
from .metrics.rebalance_watchdog import record_watch
from .metrics.connections import (CONNECTIONS_CLOSED_TOTAL, CONNECTIONS_REFUSED_TOTAL, FRAMES_RECEIVED_TOTAL,
                                  FRAMES_REJECTED_TOTAL)
from .metrics.groups import (GROUPS_EVICTED_TOTAL, GROUPS_RETIRED_TOTAL, RUNTIME_CONNECTED,
                             RUNTIME_FRAMES_DROPPED_TOTAL, RUNTIME_WINDOWS_LOST_TOTAL, init_group,
                             windows_lost_growth)
from .metrics.identity import init_static
from .metrics.jobs import JOB_ERRORS_TOTAL, JOB_MISFIRES_TOTAL, init_jobs
from .metrics.state import MetricsState
from .metrics.slo import record_annotations
from .metrics.windows import EPOCH, record_window
from .health import Check, Health, HttpSecurity, SystemdNotifier, WebServer, health_body
from .jobs import Jobs
from .receiver import CLOSED_REASONS, Connection, Limits, Receiver, TcpListenError
from .shards import ShardStep
from .throttle import Throttle
from .store import GroupStore, Store, TriagedWindow

log = logging.getLogger("moewatch.agent")

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# How long a stopping agent waits for an apply under way (a rolling restart may take minutes: it is
# left to finish on its own, and audited as unfinished).
ACTUATION_STOP_SECONDS = 5.0


class StartupError(Exception):
    """The agent cannot start; the message names the setting at fault (server.socket, server.listen, ...)."""


def _named(setting: str, value: str, exc: OSError) -> StartupError:
    return StartupError(f"{setting}: {value}: {exc.strerror or exc}")


LABEL_MAX = 256  # model and ep_group become label values on every series


def check_hello(hello: Hello, cfg: AgentConfig) -> tuple[str, str] | None:
    """(reason, detail) when a hello declares sizes no runtime can have (invalid_hello) or sizes
    beyond the configured limits (hello_over_limit); None when it may be accepted."""
    W, L, E, P = hello.world_size, hello.num_layers, hello.num_experts, hello.num_slots
    for name in ("model", "ep_group"):
        value = getattr(hello, name)
        if not value or len(value) > LABEL_MAX:
            return "invalid_hello", f"{name} must be 1 to {LABEL_MAX} characters"
    try:
        checks.check_at_least_one((("world_size", W), ("num_layers", L), ("num_experts", E), ("num_slots", P)))
        checks.check_slots_hold_experts(P, E)
        checks.check_slots_divide(P, W)
        checks.check_ranks_per_node(W, hello.ranks_per_node)
    except InputError as exc:
        return "invalid_hello", str(exc)
    limits = cfg.limits
    for name, value, limit in (("world_size", W, limits.max_world_size), ("num_layers", L, limits.max_num_layers),
                               ("num_experts", E, limits.max_num_experts), ("num_slots", P, limits.max_num_slots)):
        if value > limit:
            return "hello_over_limit", f"{name} {value} is above max_{name} {limit}"
    return None


def http_security(cfg: AgentConfig) -> HttpSecurity:
    return HttpSecurity.from_files(cfg.server.tls_cert_file, cfg.server.tls_key_file, cfg.server.basic_auth_user,
                                   cfg.server.basic_auth_password_file)


YOUNG_GC_THRESHOLD = 10_000  # container allocations between young-generation passes (CPython's default: 700)


def settle_collector() -> None:
    """The garbage collector tuned for the agent's process (called once it has started, by the process
    that runs it): what start-up made (modules, the catalogue, the scheduler) lives as long as the agent
    and is frozen out of the full passes, and a window's thousands of short-lived label tuples no longer
    set off a young-generation pass every 700 allocations (nine a window at DeepSeek-V3 size). Cycles
    are still collected, a little later."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])


class Daemon:
    def __init__(self, cfg: AgentConfig, otel_readers: Iterable[Any] = (), notifier: SystemdNotifier | None = None):
        self.cfg = cfg
        self.notifier = notifier or SystemdNotifier()
        self.metrics = MetricsState(cfg.exporters.expert_series_cap)
        self.registry = make_registry(self.metrics)
        self._otel_readers = list(otel_readers)
        self.otel = None
        self.audit: AuditLog | None = None
        self.store = Store(cfg.history.windows, cfg.limits.max_groups, cfg.history.bytes)
        self.controller: Controller | None = None
        self.receiver: Receiver | None = None
        self.web: WebServer | None = None
        self.jobs = Jobs(on_error=lambda job: self.metrics[JOB_ERRORS_TOTAL].inc((job,)),
                         on_misfire=lambda job: self.metrics[JOB_MISFIRES_TOTAL].inc((job,)),
                         log_interval=cfg.log.interval_seconds)
        self._throttle = Throttle(cfg.log.interval_seconds)
        self.health = Health()
        self.window_listeners: list[Callable[[GroupStore, TriagedWindow], None]] = []
        # (model, ep_group), or (model, ep_group, shard_index) for a shard's process (connection_key)
        self._connections: dict[tuple, Connection] = {}
        # Shards of a sharded group's windows are merged here before the store sees them.
        self.shards = ShardStep(cfg.limits, self.metrics, lambda: self.audit, self._accept_merged,
                                cfg.log.interval_seconds)
        self._conn_lock = threading.Lock()
        self._stop = threading.Event()
        self._stopped = False
        self._acks: queue.Queue = queue.Queue(maxsize=1024)
        self._ack_thread: threading.Thread | None = None
        self.actuation: ActuationWorker | None = None
        self.started_at: float | None = None
        self.sources: dict[str, Source] = {}  # integration name -> its polled Source, where its settings configure one
        # group -> (the engine rebalance check pending, the latest window's measured balancedness [L])
        self._rebalance_checks: dict[tuple[str, str], tuple[Any, Any]] = {}
        # group -> its engine rebalances so far, for /status (engine_rebalance.status_after); replaced,
        # never changed in place, so the HTTP thread reads a whole one
        self._rebalance_status: dict[tuple[str, str], dict[str, Any] | None] = {}
        # group -> the watch on the engine's own rebalancing (rebalance_watchdog.py); replaced, never changed
        self._rebalance_watch: dict[tuple[str, str], rebalance_watchdog.Watch] = {}
        # Every rebalance's cost and gain, measured on the windows around it (agent/ledger.py).
        self.ledgers = RebalanceLedgers(self.metrics, lambda: self.audit, cfg.verify.windows)

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "Daemon":
        cfg = self.cfg
        try:
            self.audit = AuditLog(cfg.log.audit_log)
        except OSError as exc:
            raise _named("log.audit_log", cfg.log.audit_log, exc) from None
        init_static(self.metrics, cfg.policy.mode)
        if cfg.exporters.otlp_endpoint or self._otel_readers:
            try:
                from .otel import OtelBridge
            except ImportError as exc:  # OpenTelemetry is the `otel` extra, not a dependency of the sidecar
                raise StartupError(f"exporters.otlp_endpoint: {cfg.exporters.otlp_endpoint}: needs OpenTelemetry "
                                   f"({exc.name} is not installed): pip install 'moewatch[otel]'") from None

            self.otel = OtelBridge(self.metrics, cfg.exporters.otlp_endpoint, cfg.exporters.otlp_interval_seconds,
                                   self._otel_readers)
        try:
            actuator = registry.build_actuator(cfg, self.connection_of)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        self.actuation = ActuationWorker(actuator, self._on_actuation)
        self.controller = Controller(cfg, self.store, self.metrics, self.audit, actuator, worker=self.actuation)
        self.controller.listeners.append(self._on_control_entry)
        for reason in ("max_connections", "out_of_descriptors", "http_max_connections"):
            self.metrics[CONNECTIONS_REFUSED_TOTAL].inc((reason,), 0)
        for reason in CLOSED_REASONS:
            self.metrics[CONNECTIONS_CLOSED_TOTAL].inc((reason,), 0)
        self.metrics[GROUPS_RETIRED_TOTAL].inc((), 0)
        self.metrics[GROUPS_EVICTED_TOTAL].inc((), 0)
        limits = Limits(max_connections=cfg.limits.max_connections, frame_deadline=cfg.limits.frame_deadline_seconds,
                        buffer_budget=cfg.limits.buffer_budget_bytes, max_outbox_bytes=cfg.limits.max_outbox_bytes,
                        log_interval=cfg.log.interval_seconds, hello_deadline=cfg.limits.hello_deadline_seconds)
        self.receiver = Receiver(cfg.server.socket, cfg.server.socket_mode_bits, cfg.limits.max_frame_bytes,
                                 on_message=self.handle_message, on_reject=self._on_reject,
                                 on_frame=lambda t: self.metrics[FRAMES_RECEIVED_TOTAL].inc((t,)),
                                 on_disconnect=self._on_disconnect, tcp=cfg.server.tcp_address, limits=limits,
                                 on_refused=self._on_refused,
                                 on_closed=lambda r: self.metrics[CONNECTIONS_CLOSED_TOTAL].inc((r,)))
        try:
            self.receiver.start()
        except FileExistsError as exc:
            raise StartupError(str(exc)) from None
        except TcpListenError as exc:
            raise _named("server.tcp_listen", cfg.server.tcp_listen, exc) from None
        except OSError as exc:
            raise _named("server.socket", cfg.server.socket, exc) from None
        host, port = cfg.server.listen_address
        try:
            self.web = WebServer(host, port, {"/metrics": self._metrics_route, "/healthz": self._healthz,
                                              "/readyz": self._readyz, "/status": self._status_route},
                                 security=http_security(cfg), max_connections=cfg.server.max_http_connections,
                                 idle_seconds=cfg.server.http_idle_seconds, log_interval=cfg.log.interval_seconds,
                                 on_refused=lambda: self._on_refused("http_max_connections"))
        except OSError as exc:
            raise _named("server.listen", cfg.server.listen, exc) from None
        except ValueError as exc:  # TLS or auth files that do not load
            raise StartupError(str(exc)) from None
        self.web.start()
        self.health.liveness["scheduler"] = lambda: Check("scheduler", self.jobs.running,
                                                          "" if self.jobs.running else "scheduler stopped")
        self.health.liveness["socket"] = lambda: Check("socket", self.receiver.listening, str(cfg.server.socket))
        self.health.readiness["audit_log"] = lambda: Check("audit_log", self.audit.writable(), str(cfg.log.audit_log))
        self._ack_thread = threading.Thread(target=self._ack_loop, name="moewatch-acks", daemon=True)
        self._ack_thread.start()
        if cfg.policy.mode != "observe" and mending_compiled.wanted():  # compile here, not in the first plan
            threading.Thread(target=self._warm_up_planner, name="moewatch-planner-warm-up", daemon=True).start()
        self.jobs.add("triage", self.triage_job, cfg.jobs.triage_interval_seconds)
        self.jobs.add("plan", self.plan_job, cfg.jobs.plan_interval_seconds)
        self.jobs.add("export", self.export_job, cfg.jobs.export_interval_seconds)
        self.sources = registry.build_sources(cfg)
        for source in self.sources.values():
            ingest = functools.partial(self.ingest_window, capabilities=source.capabilities)
            self.jobs.add(source.job_name, functools.partial(self._poll_source, source, ingest), source.poll_seconds,
                          first_run_in=0)
        if self.notifier.watchdog_seconds:
            self.jobs.add("watchdog", self.watchdog_job, self.notifier.watchdog_seconds / 2, first_run_in=0)
        init_jobs(self.metrics, [job.id for job in self.jobs.scheduler.get_jobs()])
        self.jobs.start()
        self.started_at = time.time()
        self.notifier.ready(f"serving {cfg.server.socket}, http {self.http_url}")
        tcp = f", tcp {cfg.server.tcp_address[0]}:{self.receiver.tcp_port}" if cfg.server.tcp_listen else ""
        log.info("moewatch agent %s in %s mode: socket %s%s, http %s, audit %s", __version__, cfg.policy.mode,
                 cfg.server.socket, tcp, self.http_url, cfg.log.audit_log)
        return self

    @property
    def http_url(self) -> str:
        host, _ = self.cfg.server.listen_address
        port = self.web.port if self.web else self.cfg.server.listen_address[1]
        scheme = "https" if self.cfg.server.tls_cert_file else "http"
        return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"

    def stop(self, quiet: bool = False) -> None:
        """Stop what started. `quiet` after a failed start: nothing logged or audited, so the startup
        error is the only line the operator sees."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        self.notifier.stopping()
        if self.receiver is not None:
            self.receiver.stop()
        self.jobs.shutdown()
        if self.actuation is not None:
            for left in self.actuation.stop(ACTUATION_STOP_SECONDS):
                log.warning("stopping with the apply of epoch %d for %s/%s %s", left.plan.epoch, *left.group_key,
                            f"still running after {left.seconds:g} s" if left.running else "not started")
                if self.audit is not None and not quiet:
                    self.audit.record("actuation_unfinished", model=left.group_key[0], ep_group=left.group_key[1],
                                      epoch=left.plan.epoch, running=left.running, seconds=left.seconds)
        if self._ack_thread is not None:
            self._acks.put(None)
            self._ack_thread.join(10)
        if self.web is not None:
            self.web.stop()
        if self.otel is not None:
            self.otel.shutdown()
        if self.audit is not None and quiet:
            self.audit.close()
        elif self.audit is not None:
            try:
                self.audit.record("agent_stopped", windows=sum(g.windows_accepted for g in self.store.groups()))
            except (ValueError, OSError) as exc:
                log.error("audit log: %s", exc)
            self.audit.close()
        if not quiet:
            log.info("moewatch agent stopped")

    def run_forever(self) -> int:
        """Until SIGTERM/SIGINT; then a clean stop. Returns the exit status."""
        def on_signal(signum: int, frame: Any) -> None:
            log.info("signal %d: stopping", signum)
            self._stop.set()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        started = False
        # The planner's numba loops cost the agent over 100 MB of memory for speed it does not need (it
        # plans off any engine's step budget): numpy's loops, same plans, unless the operator asks.
        mending_compiled.compile_only_when_asked()
        try:
            self.start()
            started = True
            settle_collector()
            while not self._stop.wait(1.0):
                pass
        finally:
            self.stop(quiet=not started)
            for s, handler in previous.items():
                signal.signal(s, handler)
        return 0

    # --- messages (reader threads) ------------------------------------------------------------------
    def connection_of(self, key: tuple[str, str]) -> Connection | None:
        with self._conn_lock:
            conn = self._connections.get(key)
        return None if conn is None or conn.closed.is_set() else conn

    def handle_message(self, conn: Connection, msg: Any) -> str | None:
        if isinstance(msg, Hello):
            return self._on_hello(conn, msg)
        group = self.store.get(conn.group) if conn.group else None
        if group is None:
            return "out_of_order"  # anything before a hello
        if not group.is_current(conn.id, conn.hello):
            # A connection replaced by a newer hello of its group (frames decoded in the same read as
            # it was closed): an old runtime's window or Ack must not move the new one's epoch fence.
            return "replaced"
        if isinstance(msg, Window):
            if (msg.model, msg.ep_group) != group.key:
                return "mismatch"
            if msg.shard is not None:
                hello = conn.hello
                if hello.sharded and (msg.shard.index, msg.shard.count) != (hello.shard_index, hello.shard_count):
                    return "mismatch"  # a shard's connection speaks for its own shard only
                self.shards.offer(msg)  # merged with its sequence's other shards, then accepted
                return None
            return group.accept_window(msg)
        if isinstance(msg, Ack):
            # Off the receiver's thread: the controller's lock can be held by a planning run, and the
            # receiver serves every connection. Tagged with the lineage it answers (read here, in
            # frame order): a restarted runtime's hello may be handled before this Ack is.
            try:
                self._acks.put_nowait((conn, group, msg, group.lineage))
            except queue.Full:
                return "backlog"
            return None
        if isinstance(msg, Heartbeat):
            # The runtime reports its process's cumulative count; the group keeps it across reconnects
            # of the same process (GroupStore.on_hello resets it for a new one), so only growth counts;
            # a sharded group keeps one per shard (its processes count on their own).
            sharded = conn.hello is not None and conn.hello.sharded
            grown = group.note_heartbeat(msg.frames_dropped, conn.hello.shard_index if sharded else None)
            if grown > 0:
                self.metrics[RUNTIME_FRAMES_DROPPED_TOTAL].inc(group.key, grown)
            # The engine adapters' lost windows, by reason: kept per process, as several processes
            # (the shards of a group) may report into one group.
            pid = conn.hello.pid if conn.hello is not None else 0
            with group.lock:
                lost = windows_lost_growth(group.runtime_windows_lost, pid, msg.extra.get("windows_lost"))
            for reason, count in lost.items():
                self.metrics[RUNTIME_WINDOWS_LOST_TOTAL].inc((*group.key, reason), count)
            return None
        if isinstance(msg, Plan):
            return "unexpected"  # plans flow agent -> runtime only
        return "unexpected"

    def _on_actuation(self, group_key: tuple[str, str], plan: Plan, actuation, seconds: float) -> None:
        """An apply's outcome (the actuation worker's thread) joins the runtimes' Acks on the Ack thread."""
        try:
            self._acks.put(("actuation", group_key, plan, actuation, seconds), timeout=5)
        except queue.Full:
            self.controller.on_actuation(group_key, plan, actuation, seconds)

    def _ack_loop(self) -> None:
        while True:
            item = self._acks.get()
            if item is None:
                return
            if item[0] == "actuation":
                try:
                    self.controller.on_actuation(*item[1:])
                except Exception:
                    log.exception("actuation outcome handling failed")
                continue
            conn, group, ack, lineage = item
            try:
                reason = self.controller.on_ack(group, ack, lineage)
            except Exception:
                log.exception("ack handling failed")
                reason = "handler_error"
            if reason is not None:
                self._on_reject(conn, reason, f"ack rejected: {reason}")

    @staticmethod
    def connection_key(hello: Hello) -> tuple:
        """Whose connection it is: the group's, or one shard's of a sharded group (shards do not
        replace each other; connection_of(group) finds none, so a sharded group is sent no plans)."""
        key = (hello.model, hello.ep_group)
        return (*key, hello.shard_index) if hello.sharded else key

    def _on_hello(self, conn: Connection, hello: Hello) -> str | None:
        key = (hello.model, hello.ep_group)
        if conn.group is not None and self.connection_key(conn.hello) != self.connection_key(hello):
            return "mismatch"  # another group, or another shard of it, on the same connection
        problem = check_hello(hello, self.cfg)
        if problem is not None:
            reason, detail = problem
            self._on_reject(conn, reason, f"hello rejected: {detail}", count=False)
            return reason
        group = self._group_for(key)
        if group is None:
            return "too_many_groups"
        init_group(self.metrics, key)
        if hello.sharded:
            self.shards.on_hello(key)
        conn_key = self.connection_key(hello)
        with self._conn_lock:
            old = self._connections.get(conn_key)
            self._connections[conn_key] = conn
        if old is not None and old is not conn:
            self._throttle.log(log, logging.INFO, "replace", "group %s/%s: connection %d replaces %d", *key, conn.id,
                               old.id)
            old.close()
        conn.group, conn.hello = key, hello
        if group.on_hello(hello, conn.id):
            self._throttle.log(log, logging.INFO, "lineage", "group %s/%s: runtime %s (pid %d) at epoch %d starts a "
                               "new lineage", *key, hello.runtime, hello.pid, hello.epoch)
            self.shards.forget(key)  # the shards held were the old processes'
            self.controller.abandon(group, f"runtime restarted (hello at epoch {hello.epoch})")
        self.metrics[RUNTIME_CONNECTED].set(key, 1)
        self.metrics[EPOCH].set(key, hello.epoch)
        # Connect, replace and disconnect lines are throttled like rejections: one per kind per log interval
        # with a tally (a peer reconnecting in a loop, or many hostile ones, would flood the log).
        self._throttle.log(log, logging.INFO, "connect", "runtime %s (pid %d) connected: %s/%s, %d ranks, %d layers, "
                           "%d experts in %d slots, epoch %d", hello.runtime, hello.pid, *key, hello.world_size,
                           hello.num_layers, hello.num_experts, hello.num_slots, hello.epoch)
        return None

    def ingest_window(self, window: Window, capabilities: Iterable[str] = ()) -> str | None:
        """A window from a polled source (no connection): its group is created, or re-sized, from the
        window itself, with the capabilities the source declares, then it passes the same gate as a
        runtime's. Returns the rejection reason."""
        key = (window.model, window.ep_group)
        group = self._group_for(key)
        if group is None:
            reason = "too_many_groups"
        else:
            hello = group.hello
            sizes = (window.world_size, window.num_layers, window.num_experts, window.num_slots)
            if hello is None or (hello.world_size, hello.num_layers, hello.num_experts, hello.num_slots) != sizes:
                init_group(self.metrics, key)
                hello = Hello(runtime=window.runtime, model=key[0], ep_group=key[1], world_size=sizes[0],
                              num_layers=sizes[1], num_experts=sizes[2], num_slots=sizes[3], epoch=window.epoch,
                              ranks_per_node=window.ranks_per_node, capabilities=tuple(capabilities))
                new_lineage = group.on_hello(hello, connection_id=0)
                if new_lineage:
                    self.controller.abandon(group, "the source restarted with other sizes")
            reason = group.accept_window(window)
        if reason is not None:
            self._on_reject(None, reason, f"{window.runtime} window of {key[0]}/{key[1]}")
        return reason

    def _accept_merged(self, window: Window) -> str | None:
        """A window merged from a sharded group's shards passes the same gate as a runtime's."""
        key = (window.model, window.ep_group)
        group = self.store.get(key)
        reason = "out_of_order" if group is None else group.accept_window(window)
        if reason is not None:
            self._on_reject(None, reason, f"merged window of {key[0]}/{key[1]}")
        return reason

    def _on_reject(self, conn: Connection | None, reason: str, detail: str, count: bool = True) -> None:
        if count:
            self.metrics[FRAMES_REJECTED_TOTAL].inc((reason,))
            if reason in ("invalid_hello", "hello_over_limit"):
                return  # logged with its detail by _on_hello
        # Under attack every frame may be bad: one line per reason per interval, with a tally.
        held = self._throttle(f"reject:{reason}")
        if held is not None:
            log.info("connection %s: frame rejected (%s): %s%s", getattr(conn, "id", "-"), reason, detail,
                     f" ({held} more rejected for this reason since the last line)" if held else "")

    def _on_refused(self, reason: str) -> None:
        self.metrics[CONNECTIONS_REFUSED_TOTAL].inc((reason,))

    def _on_disconnect(self, conn: Connection) -> None:
        if conn.group is None:
            return
        conn_key = self.connection_key(conn.hello) if conn.hello is not None else conn.group
        with self._conn_lock:
            if self._connections.get(conn_key) is conn:
                del self._connections[conn_key]
        group = self.store.get(conn.group)
        if group is not None and group.on_disconnect(conn.id):
            self.metrics[RUNTIME_CONNECTED].set(conn.group, 0)
            self._throttle.log(log, logging.INFO, "disconnect", "runtime of %s/%s disconnected", *conn.group)

    # --- jobs ---------------------------------------------------------------------------------------
    def _per_group(self, job: str, group: GroupStore, work: Callable[[], None]) -> None:
        """One group's share of a job: a failure is counted and logged (throttled) and the job goes on
        with the other groups."""
        try:
            work()
        except Exception as exc:
            self.metrics[JOB_ERRORS_TOTAL].inc((job,))
            if self._throttle(f"job:{job}:{group.key}") is not None:
                log.exception("job %s failed for group %s/%s: %r", job, *group.key, exc)

    def plan_job(self) -> None:
        for group in self.store.groups():
            self._per_group("plan", group, lambda g=group: self.controller.plan_group(g))

    def triage_job(self) -> None:
        """Triage every window that arrived since the last run, in order (sharded groups' sequences
        whose deadline passed are merged first)."""
        self.shards.flush_due()
        for group in self.store.groups():
            self._per_group("triage", group, lambda g=group: self._triage_group(g))

    def _triage_group(self, group: GroupStore) -> None:
        for window in group.take_untriaged():
            window = self._annotated(window)
            diagnosis = diagnose(window, self.cfg.thresholds)
            record_window(self.metrics, group.export, window, diagnosis, self.cfg.exporters.expert_metrics)
            self._engine_rebalance(group, window)
            self._watch_rebalancing(group, window)
            self.ledgers.on_window(group.key, window)
            triaged = TriagedWindow(window, diagnosis, time.time())
            if not group.add_triaged(triaged):
                continue  # the old lineage's: exported, never counted for the new runtime
            self.controller.on_window(group, triaged)
            for listener in self.window_listeners:
                try:
                    listener(group, triaged)
                except Exception:
                    log.exception("window listener failed")

    def _engine_rebalance(self, group: GroupStore, window: Window) -> None:
        """The engine's own rebalances with moewatch's policy: audit each record the window carries,
        and settle the check of the previous one on this window's measured balancedness."""
        records = engine_rebalance_metrics.records_of(window)
        if self.audit is not None:
            for record in records:
                self.audit.record("engine_rebalance", model=group.key[0], ep_group=group.key[1],
                                  window_end=window.end_time, decision=record)
        pending, previous = self._rebalance_checks.get(group.key, (None, None))
        current = tm.balancedness(window)
        pending, verdict = engine_rebalance.step(pending, previous, current, records,
                                                 self.cfg.verify.rollback_balancedness_drop)
        self._rebalance_checks[group.key] = (pending, current)
        self._rebalance_status[group.key] = engine_rebalance.status_after(
            self._rebalance_status.get(group.key), records, verdict, window.end_time)
        if verdict is None:
            return
        self.metrics[engine_rebalance_metrics.VERDICTS_TOTAL].inc((*group.key, verdict["verdict"]))
        if verdict["layers_worse"]:
            self.metrics[engine_rebalance_metrics.LAYERS_WORSE_TOTAL].inc(group.key, len(verdict["layers_worse"]))
        if self.audit is not None:
            self.audit.record("engine_rebalance_verdict", model=group.key[0], ep_group=group.key[1],
                              window_end=window.end_time, **verdict)
        if verdict["layers_worse"]:
            log.warning("engine rebalance made layers %s of %s/%s worse (measured balancedness %s -> %s)",
                        verdict["layers_worse"], *group.key, verdict["balancedness_before"],
                        verdict["balancedness_after"])

    def _watch_rebalancing(self, group: GroupStore, window: Window) -> None:
        """Count the engine's steps since its last rebalance against its configured interval (the
        window's extra.rebalancing), and the stall of a rebalance's window; say when one becomes overdue."""
        try:
            settings = RebalancingSettings.from_extra(window.extra)
        except (TypeError, ValueError) as exc:  # the runtime's input: left out, said at most once an interval
            self._throttle.log(log, logging.WARNING, f"rebalancing:{group.key}",
                               "group %s/%s: ignoring the window's rebalancing settings (%s)", *group.key, exc)
            settings = None
        rebalanced = rebalance_watchdog.rebalance_calls(window.extra) > 0
        before = self._rebalance_watch.get(group.key, rebalance_watchdog.Watch())
        watch = rebalance_watchdog.step(before, settings, window.steps, rebalanced)
        self._rebalance_watch[group.key] = watch
        stall = rebalance_watchdog.step_stall_seconds(window.step_seconds) if rebalanced else None
        record_watch(self.metrics, group.key, watch, stall)
        if watch.overdue and not before.overdue:
            log.warning("group %s/%s: no engine rebalance in %d steps (configured every %d, %s): its rebalancing "
                        "has stopped", *group.key, watch.steps_since, watch.settings.interval_steps,
                        watch.settings.source)
            if self.audit is not None:
                self.audit.record("engine_rebalance_overdue", model=group.key[0], ep_group=group.key[1],
                                  window_end=window.end_time, steps_since=watch.steps_since,
                                  interval_steps=watch.settings.interval_steps)

    def _on_control_entry(self, entry: dict[str, Any]) -> None:
        """A plan the controller put in force joins its group's rebalance ledger (on the Ack thread)."""
        group = self.store.get((entry.get("model"), entry.get("ep_group")))
        hello = None if group is None else group.hello
        self.ledgers.on_control_entry(entry, "" if hello is None else hello.runtime)

    @staticmethod
    def _warm_up_planner() -> None:
        try:
            log.info("planner: %s", mending_compiled.warm_up_packing())
        except Exception:  # a warm-up never stops the agent: the first plan compiles instead
            log.exception("planner warm-up failed")

    def _poll_source(self, source: Source, ingest: Callable[[Window], str | None]) -> None:
        """One poll of a source; then what it knows of each group beside the windows (an engine's SLO
        interval) goes to /metrics at once, not with the group's next window: an engine that went idle
        sends none, and its last requests' latencies would never show."""
        source.poll(ingest)
        annotations = getattr(source, "annotations", None)
        if annotations is not None:
            for key, extra in annotations().items():
                record_annotations(self.metrics, key, extra)

    def _annotated(self, window):
        """The window with what sources know of its group beside it (an engine's SLO signals): each
        source that has `annotate` adds to `extra`; a failing one leaves the window as it was."""
        for name, source in self.sources.items():
            annotate = getattr(source, "annotate", None)
            if annotate is None:
                continue
            try:
                window = annotate(window)
            except Exception:
                if self._throttle(f"annotate:{name}") is not None:
                    log.exception("source %s could not annotate a window", name)
        return window

    def export_job(self) -> None:
        self.retire_groups()
        for group in self.store.groups():
            self.metrics[RUNTIME_CONNECTED].set(group.key, 1 if group.connected else 0)
        self.controller.check_timeouts()
        if self.audit is not None:
            self.audit.sync()

    def retire_groups(self, now: float | None = None) -> list[tuple[str, str]]:
        """Forget groups whose runtime left and sent nothing for group_retire_seconds: their store,
        control state and series go, so they neither fill max_groups nor linger on /metrics."""
        now = time.time() if now is None else now
        retired = []
        for group in self.store.groups():
            with group.lock:
                if group.connected or group.left_at is None:
                    continue
                last = max(t for t in (group.left_at, group.last_window_received, group.last_heartbeat)
                           if t is not None)
                if now - last < self.cfg.limits.group_retire_seconds:
                    continue
            self._forget_group(group, "retired", idle_seconds=round(now - last, 3))
            log.info("group %s/%s retired: no runtime for %.0f s", *group.key, now - last)
            retired.append(group.key)
        return retired

    def _forget_group(self, group: GroupStore, how: str, **fields: Any) -> None:
        """Drop a group whose runtime left (`how`: retired or evicted): its plans are abandoned, its
        store, control state and series go, and it is counted and audited (group_{how})."""
        self.controller.abandon(group, f"group {how}: its runtime left")
        self.store.remove(group.key)
        self.controller.forget(group.key)
        self.shards.forget(group.key)
        self._rebalance_checks.pop(group.key, None)
        self._rebalance_watch.pop(group.key, None)
        self.ledgers.forget(group.key)
        self.metrics.remove_group(group.key)
        self.metrics[GROUPS_EVICTED_TOTAL if how == "evicted" else GROUPS_RETIRED_TOTAL].inc(())
        if self.audit is not None:
            self.audit.record(f"group_{how}", model=group.key[0], ep_group=group.key[1],
                              windows=group.windows_accepted, **fields)

    def _group_for(self, key: tuple[str, str]) -> GroupStore | None:
        """The group's store, created if new. At max_groups a live runtime never waits for gone ones:
        the group disconnected the longest is evicted to make room; None only when every group kept
        has a runtime connected."""
        group = self.store.get_or_create(key)
        while group is None:
            victim = self.store.longest_disconnected()
            if victim is None:
                return None
            left = victim.left_at
            self._forget_group(victim, "evicted", for_group=list(key),
                               disconnected_seconds=None if left is None else round(time.time() - left, 3))
            log.info("group %s/%s evicted for %s/%s: max_groups %d reached", *victim.key, *key, self.cfg.limits.max_groups)
            group = self.store.get_or_create(key)
        return group

    def watchdog_job(self) -> None:
        ok, checks = self.health.live()
        if ok:
            self.notifier.watchdog()
        else:
            log.error("not pinging the watchdog: %s", "; ".join(f"{c.name}: {c.detail}" for c in checks if not c.ok))

    # --- HTTP routes ----------------------------------------------------------------------------------
    def _metrics_route(self) -> tuple[int, str, bytes]:
        return 200, PROMETHEUS_CONTENT_TYPE, render(self.registry)

    def _healthz(self) -> tuple[int, str, bytes]:
        ok, checks = self.health.live()
        return (200 if ok else 503), "application/json", health_body(ok, checks)

    def _readyz(self) -> tuple[int, str, bytes]:
        ok, checks = self.health.ready()
        return (200 if ok else 503), "application/json", health_body(ok, checks)

    def status(self) -> dict[str, Any]:
        groups = []
        for group in self.store.groups():
            item = group.status()
            item["control"] = self.controller.status(group.key)
            item["engine_rebalance"] = self._rebalance_status.get(group.key)
            watch = self._rebalance_watch.get(group.key)
            item["rebalancing"] = None if watch is None or watch.settings is None else {
                **watch.settings.to_extra()["rebalancing"], "steps_since": watch.steps_since,
                "rebalances": watch.rebalances, "overdue": watch.overdue}
            item["shards"] = self.shards.status(group.key)
            item["ledger"] = self.ledgers.status(group.key)
            groups.append(item)
        return {"agent": {"version": __version__, "mode": self.cfg.policy.mode, "socket": self.cfg.server.socket,
                          "started_at": self.started_at, "audit_log": self.cfg.log.audit_log,
                          "frames_rejected": dict(self._series("moewatch_frames_rejected_total")),
                          "frames_received": dict(self._series("moewatch_frames_received_total"))},
                "groups": groups, **{name: self.sources[name].status() if name in self.sources else None
                                     for name in registry.polled_integrations()}}

    def _series(self, name: str) -> list[tuple[str, float]]:
        return [(labels[0], value) for labels, value in self.metrics.series(name)]

    def _status_route(self) -> tuple[int, str, bytes]:
        return 200, "application/json", json.dumps(jsonable(self.status()), allow_nan=False).encode()
