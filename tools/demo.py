"""`moewatch demo`: the whole loop on this machine's CPUs.

The reference runtime (`moewatch runtime`, a subprocess: 4 gloo ranks, a workload whose hot experts
move every few hundred steps) connects to the agent (in this process, act mode, tuned to react in
seconds rather than minutes) through a socket in a fresh folder. Each window's per-layer verdicts and
each of the agent's actions are printed as they happen; at the end, a summary: windows seen, verdicts,
actions applied and skipped, balancedness and step time before and after the agent's first plan took
effect, pairs lost (the runtime's own count: routed - computed - dropped), the agent's CPU share and
memory while ingesting, and where the audit log and /metrics were.

Before/after: "before" is every window at the runtime's starting epoch (no plan of the agent in force),
"after" every window at a later epoch. After includes the windows right after each drift, before the
agent catches up, so it is what an operator would have seen, not the best case.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

import contextlib

import click
import numpy as np

from moewatch import telemetry as tm
from moewatch.agent.config import build_config
from moewatch.agent.store import GroupStore, TriagedWindow
from moewatch.cli_contract import OneLineCommand, fail_input
from moewatch.thresholds import ConfigError
from moewatch.tools.bench.record import recorded
from moewatch.vocabulary import TERMINAL_COLOURS

# The demo's EP group: each rank on its own core(s), so the busiest rank sets the step; two hot
# experts carrying 70 % of the pairs start on rank 0, and spare slots (12 for 8 experts) leave the
# agent room to replicate them. Small experts (128 x 512, their weights stay in cache) and many
# tokens per expert keep a rank's expert time proportional to its pairs: with big experts and few
# rows per expert a CPU matmul streams the weights whatever the rows, and balancing barely moves it.
DEMO_RUNTIME = {
    "layers": 4, "experts": 8, "slots": 12, "top-k": 2, "hidden": 128, "ffn": 512, "batch-tokens": 1024,
    "workload": "zipf", "zipf": 0.0, "hot-experts": 2, "hot-share": 0.7, "hot-on-rank": 0,
    "window-steps": 16, "warmup-steps": 2, "model-name": "demo", "ep-group": "ep0",
}
# On GPUs (one rank per GPU, NCCL) the same skew on a shape that keeps a GPU busy.
DEMO_RUNTIME_GPU = {**DEMO_RUNTIME, "hidden": 2048, "ffn": 4096, "batch-tokens": 4096, "window-steps": 20,
                    "backend": "nccl", "dtype": "bfloat16"}
# The agent reacts in seconds (a production default is minutes).
DEMO_AGENT = {
    "policy.mode": "act", "policy.persist_windows": 2, "verify.windows": 3, "jobs.plan_interval_seconds": 0.5,
    "jobs.triage_interval_seconds": 0.2, "jobs.export_interval_seconds": 1.0, "policy.cooldown_seconds": 10.0,
    "policy.max_plans_per_hour": 120, "policy.horizon_seconds": 300.0, "history.windows": 256,
    # Weights move over shared memory (gloo) or NVLink/PCIe (NCCL); cost.expert_bytes follows the shape.
    "cost.migration_bandwidth_bytes_per_second": 1e9,
}


def agent_settings(runtime_flags: dict[str, Any], changes: dict[str, Any] | None = None) -> dict[str, Any]:
    """DEMO_AGENT with the bytes of one expert of this runtime shape (three hidden x ffn matrices), then
    `changes` ({"section.field": value})."""
    element = 2 if runtime_flags.get("dtype") in ("bfloat16", "float16") else 4
    expert_bytes = 3 * int(runtime_flags["hidden"]) * int(runtime_flags["ffn"]) * element
    return {**DEMO_AGENT, "cost.expert_bytes": expert_bytes, **(changes or {})}


@contextlib.contextmanager
def scheduler_warnings_muted():
    """While the runtime's ranks hold every core the agent's jobs miss runs by design: mute those
    warnings for the session, and give the loggers back as they were (callers may be long-lived)."""
    names = ("apscheduler", "moewatch.agent.jobs")
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def visible_gpus() -> int:
    """CUDA GPUs the runtime would see (0 without a driver). Asked of a subprocess: the agent never
    imports torch, and a machine without an NVIDIA device node is answered without starting one."""
    if not (os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi")):
        return 0
    try:
        proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count() "
                               "if torch.cuda.is_available() else 0)"], capture_output=True, text=True, timeout=120)
        return int(proc.stdout.strip() or 0) if proc.returncode == 0 else 0
    except (subprocess.TimeoutExpired, ValueError, OSError):
        return 0


def default_ranks(gpus: int) -> int:
    """One rank per GPU; on CPUs one per core this process may use (2 to 4), so each has its own."""
    if gpus:
        return gpus
    return min(4, max(2, len(os.sched_getaffinity(0))))


class DemoError(Exception):
    pass


def _short(verdict: str, cause: str | None) -> str:
    v = {"healthy": "ok", "comm-bound": "comm", "imbalance-bound": "imbal"}[verdict]
    return v if not cause else f"{v}/{cause}"


def _colour(text: str, verdict: str, enabled: bool) -> str:
    if not enabled:
        return text
    return click.style(text, fg=TERMINAL_COLOURS[verdict])


class Recorder:
    """Collects what the summary needs from the agent's window and audit callbacks."""

    def __init__(self, live: bool, started: float, err: bool = False, prefix: str = ""):
        self.live = live
        self.started = started
        self.err = err  # progress on stderr (the bench keeps stdout for its JSON)
        self.prefix = prefix
        self.colour = live and (sys.stderr if err else sys.stdout).isatty()
        self.windows: list[TriagedWindow] = []
        self.events: list[dict[str, Any]] = []
        self.ledger: list[dict[str, Any]] = []  # the rebalance ledger's settled entries
        self.first_window_at: tuple[float, resource.struct_rusage] | None = None
        self.last_window_at: tuple[float, resource.struct_rusage] | None = None
        self.lock = threading.Lock()
        self._last_skip: dict[tuple, str] = {}

    def _print(self, text: str) -> None:
        if self.live:
            click.echo(f"{self.prefix}[{time.monotonic() - self.started:6.1f}s] {text}", err=self.err)

    def on_window(self, group: GroupStore, t: TriagedWindow) -> None:
        now = (time.monotonic(), resource.getrusage(resource.RUSAGE_SELF))
        with self.lock:
            if self.first_window_at is None:
                self.first_window_at = now
            self.last_window_at = now
            self.windows.append(t)
        w = t.window
        layers = "  ".join(_colour(f"L{d.layer} {_short(d.verdict, d.cause):<17}", d.verdict, self.colour)
                           + f" {d.metrics['balancedness']:.2f}" for d in t.diagnosis.layers)
        p99 = float(np.percentile(w.step_seconds, 99)) * 1e3
        self._print(f"window {len(self.windows):3d} epoch {w.epoch:2d}  {layers}  step p99 {p99:5.0f} ms")

    def on_event(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.events.append(entry)
        event = entry["event"]
        if event == "decision" and entry["result"] == "skipped":
            # A standing reason repeats every planning run: print it when it first appears.
            key = (tuple(entry["layers"]), entry["kind"])
            gist = re.sub(r"[0-9.]+", "#", entry["reason"])
            if self._last_skip.get(key) == gist:
                return
            self._last_skip[key] = gist
            self._print(f"  skipped {entry['kind']} layer {','.join(map(str, entry['layers']))}: {entry['reason']}")
        elif event == "decision":
            self._print(f"  decide  {entry['kind']} layer {','.join(map(str, entry['layers']))}: {entry['reason']}")
        elif event == "plan_sent":
            self._print(f"  -> plan epoch {entry['epoch']} sent ({', '.join(entry['kinds'])}, layers "
                        f"{','.join(map(str, entry['layers']))})")
        elif event == "plan_applied":
            self._print(f"  <- ack: epoch {entry['epoch']} in force (stall {entry['stall_seconds'] * 1e3:.0f} ms)")
        elif event in ("rank_slow", "rank_recovered"):
            self._print(f"  {event}: rank {entry['rank']} at {entry['relative_speed']:.2f}x the median rank's speed "
                        f"({entry['pairs_per_second']:,.0f} pairs/s)")
        elif event in ("verified", "rollback", "rolled_back", "plan_failed", "plan_invalid"):
            self._print(f"  {event}: epoch {entry.get('epoch')} {entry.get('reason') or entry.get('error') or ''}")


    def on_ledger(self, group: tuple[str, str], entry: dict[str, Any]) -> None:
        with self.lock:
            self.ledger.append(entry)
        epoch = (entry.get("plan") or {}).get("epoch")
        whose = f"epoch {epoch}'s plan" if epoch is not None else entry["policy"]
        self._print(f"  ledger: {whose} {LEDGER_OUTCOMES.get(entry['outcome'], entry['outcome'])}: "
                    + ledger_figures(entry))


LEDGER_KEYS = ("policy", "outcome", "slots_moved", "balancedness_before", "balancedness_after", "step_seconds_before",
               "step_seconds_after", "stall_seconds", "gain_seconds_per_step", "net_seconds", "horizon_steps",
               "horizon", "break_even_steps")
LEDGER_OUTCOMES = {"paid": "paid", "did_not_pay": "did not pay", "unknown": "unknown (no step times)"}


def ledger_figures(entry: dict[str, Any]) -> str:
    """A ledger entry's measured figures in a line: stall, gain, net over its horizon, break-even."""
    even = entry.get("break_even_steps")
    return (f"stall {_fmt(entry.get('stall_seconds'), ' ms', 1e3, 0)}, gain "
            f"{_fmt(entry.get('gain_seconds_per_step'), ' ms/step', 1e3, 2)}, net "
            f"{_fmt(entry.get('net_seconds'), ' s', 1, 2)} over {entry.get('horizon_steps')} steps, break-even "
            + ("never" if even is None else f"{even:.0f} steps"))


def runtime_command(socket_path: str, seconds: float, ranks: int, flags: dict[str, Any]) -> list[str]:
    cmd = [sys.executable, "-m", "moewatch.cli", "runtime", "--ranks", str(ranks), "--steps", "0",
           "--seconds", f"{seconds:g}", "--socket", socket_path, "--json"]
    for key, value in flags.items():
        cmd += [f"--{key}", str(value)]
    return cmd


def _rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process."""
    current = peak = 0
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                current = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return current, peak


def _cpu(r: resource.struct_rusage) -> float:
    return r.ru_utime + r.ru_stime


def _mean_balancedness(windows: list[TriagedWindow]) -> float | None:
    if not windows:
        return None
    return float(np.mean([[d.metrics["balancedness"] for d in t.diagnosis.layers] for t in windows]))


def mean_time_balancedness(windows: list[TriagedWindow]) -> float | None:
    """Mean over windows and layers of balancedness by time (mean/max of the ranks' expert compute):
    what a plan for a slow rank raises while plain balancedness falls. None without compute times."""
    values = [tm.time_balancedness(t.window) for t in windows]
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def step_times(windows: list[TriagedWindow]) -> np.ndarray:
    return np.concatenate([t.window.step_seconds for t in windows]) if windows else np.array([])


def percentile(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


@dataclass
class Session:
    """One runtime run with the agent beside it: what the summaries are computed from."""

    windows: list[TriagedWindow]
    events: list[dict[str, Any]]
    runtime: dict[str, Any]  # the runtime's --json result
    rejected: dict[str, int]
    cpu_share: float | None
    current_rss: int
    peak_rss: int
    audit_log: str
    metrics_url: str
    work: Path
    ledger: list[dict[str, Any]]  # the rebalance ledger's settled entries, in order


def run_session(work: Path, runtime_flags: dict[str, Any], agent_flags: dict[str, Any], seconds: float, ranks: int,
                listen: str = "127.0.0.1:0", recorder: Recorder | None = None,
                announce: Callable[[str], None] | None = None) -> Session:
    """Start an agent (in this process) on a socket in `work`, run `moewatch runtime` against it for
    `seconds`, wait for the agent to triage the last windows, stop the agent."""
    from moewatch.agent.daemon import Daemon
    from moewatch.planner import mending_compiled

    work.mkdir(parents=True, exist_ok=True)
    socket_path = str(work / "agent.sock")
    if len(socket_path.encode()) > 100:  # sun_path holds 108 bytes
        raise DemoError(f"--keep: {work} is too long a path for a unix socket inside it")
    cfg = build_config(flags={**agent_flags, "server.socket": socket_path, "server.listen": listen,
                              "log.audit_log": str(work / "audit.jsonl")}, environ={})
    recorder = recorder or Recorder(False, time.monotonic())
    # As `moewatch agent` runs its planner: numpy's loops unless MOEWATCH_PLANNER_COMPILED is set on
    # (numba would add over 100 MB to the agent's memory the summary reports).
    mending_compiled.compile_only_when_asked()
    daemon = Daemon(cfg)
    daemon.window_listeners.append(recorder.on_window)
    daemon.ledgers.listeners.append(recorder.on_ledger)
    daemon.start()
    daemon.controller.listeners.append(recorder.on_event)
    metrics_url = daemon.http_url + "/metrics"
    if announce is not None:
        announce(metrics_url)
    log_path = work / "runtime.log"
    try:
        with open(log_path, "w", encoding="utf-8") as log_file:
            proc = subprocess.run(runtime_command(socket_path, seconds, ranks, runtime_flags), stdout=subprocess.PIPE,
                                  stderr=log_file, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                  timeout=seconds + 300)
        if proc.returncode != 0:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise DemoError(f"the runtime exited {proc.returncode}: {' / '.join(tail)} (log: {log_path})")
        try:
            runtime = json.loads(proc.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            raise DemoError(f"the runtime printed no result (log: {log_path})") from None
        # The last windows may still be in the triage job's queue.
        group = daemon.store.get((runtime_flags["model-name"], runtime_flags["ep-group"]))
        deadline = time.monotonic() + 5
        while group is not None and group.untriaged and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2 * cfg.jobs.triage_interval_seconds)
        current_rss, peak_rss = _rss_bytes()
        rejected = {labels[0]: int(v) for labels, v in daemon.metrics.series("moewatch_frames_rejected_total")}
    except subprocess.TimeoutExpired:
        raise DemoError(f"the runtime did not finish within {seconds + 300:g} s (log: {log_path})") from None
    finally:
        daemon.stop()
    with recorder.lock:
        windows, events, ledger = list(recorder.windows), list(recorder.events), list(recorder.ledger)
        first, last = recorder.first_window_at, recorder.last_window_at
    ingest_wall = (last[0] - first[0]) if first and last and last[0] > first[0] else None
    cpu_share = (_cpu(last[1]) - _cpu(first[1])) / ingest_wall if ingest_wall else None
    return Session(windows, events, runtime, rejected, cpu_share, current_rss, peak_rss, str(cfg.log.audit_log),
                   metrics_url, work, ledger)


# --- steady state ---------------------------------------------------------------------------------

def migration_spans(events: list[dict[str, Any]]) -> list[tuple[float, float, int]]:
    """(sent, answered, epoch) of every plan's migration, unix times from the audit entries; a plan
    still unanswered at the end runs to infinity."""
    spans, open_at = [], None
    for e in events:
        if e["event"] == "plan_sent":
            open_at = (e["time"], int(e["epoch"]))
        elif e["event"] in ("plan_applied", "rolled_back", "plan_failed") and open_at is not None:
            spans.append((open_at[0], e["time"], open_at[1]))
            open_at = None
    if open_at is not None:
        spans.append((open_at[0], math.inf, open_at[1]))
    return spans


def steady_windows(windows: list[TriagedWindow], events: list[dict[str, Any]]) -> list[TriagedWindow]:
    """Windows whose steps carried no migration: none at an older epoch than a plan that was moving
    weights while the window ran (a plan's own epoch starts once its weights are in place)."""
    spans = migration_spans(events)
    return [t for t in windows
            if not any(t.window.epoch < epoch and t.window.start_time < end and t.window.end_time > start
                       for start, end, epoch in spans)]


def step_figures(windows: list[TriagedWindow], events: list[dict[str, Any]], warmup_steps: int = 0) -> dict[str, Any]:
    """Step p50/p99 before (the starting epoch, the run's first `warmup_steps` left out) and after
    (every later epoch), both on steady-state windows only; the migration stall apart, per plan."""
    start_epoch = windows[0].window.epoch if windows else 0
    steady = {id(t) for t in steady_windows(windows, events)}
    before = [t for t in windows if t.window.epoch == start_epoch and id(t) in steady]
    after = [t for t in windows if t.window.epoch > start_epoch and id(t) in steady]
    steps_before, steps_after = step_times(before), step_times(after)
    if before and before[0] is windows[0]:
        steps_before = steps_before[warmup_steps:]
    stalls = [float(e.get("stall_seconds") or 0.0) for e in events if e["event"] in ("plan_applied", "rolled_back")]
    return {
        "windows_before": len(before), "windows_after": len(after),
        "balancedness_before": _mean_balancedness(before), "balancedness_after": _mean_balancedness(after),
        "time_balancedness_before": mean_time_balancedness(before),
        "time_balancedness_after": mean_time_balancedness(after),
        "step_p50_before_s": percentile(steps_before, 50), "step_p50_after_s": percentile(steps_after, 50),
        "step_p99_before_s": percentile(steps_before, 99), "step_p99_after_s": percentile(steps_after, 99),
        "migration_stall_s": {"total": float(sum(stalls)), "per_plan": stalls},
    }


def old_map_figures(events: list[dict[str, Any]]) -> dict[str, float | None] | None:
    """The agent's control figures: for its verified plans, the changed layers' measured balancedness
    and time per step on the new map, and what the old map gives on the same traffic (means)."""
    numbers = [n for e in events if e["event"] in ("verified", "rollback") for n in (e.get("numbers") or {}).values()]
    if not numbers:
        return None
    keys = ("balancedness_after", "balancedness_old_map_same_load", "layer_seconds_after",
            "layer_seconds_old_map_same_load")
    out: dict[str, float | None] = {}
    for k in keys:
        present = [n[k] for n in numbers if n.get(k) is not None]
        out[k] = float(np.mean(present)) if present else None  # not measured in any verified layer
    return out


def run_demo(seconds: float = 45.0, ranks: int | None = None, folder: str | None = None,
             listen: str = "127.0.0.1:0", live: bool = True) -> dict[str, Any]:
    work = Path(folder) if folder else Path(tempfile.mkdtemp(prefix="moewatch-demo-"))
    gpus = visible_gpus()
    flags = DEMO_RUNTIME_GPU if gpus else DEMO_RUNTIME
    ranks = ranks or default_ranks(gpus)
    build_config(flags={**agent_settings(flags), "server.socket": str(work / "agent.sock"), "server.listen": listen},
                 environ={})  # bad --listen
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    recorder = Recorder(live, started)

    def announce(metrics_url: str) -> None:
        if not live:
            return
        device = f"{ranks} GPU ranks (NCCL)" if gpus else f"{ranks} CPU ranks (gloo, one per core)"
        click.echo(f"moewatch demo: reference runtime on {device}, {flags['layers']} layers, {flags['experts']} "
                   f"experts in {flags['slots']} slots; {flags['hot-experts']} hot experts carrying "
                   f"{flags['hot-share']:.0%} of pairs start on rank 0; {seconds:g} s; agent in act mode")
        click.echo(f"  folder {work}\n  metrics {metrics_url}\n  audit log {work / 'audit.jsonl'}")
        click.echo("  starting the runtime's ranks (torch import and process group setup take a few seconds)...")

    with scheduler_warnings_muted():
        session = run_session(work, flags, agent_settings(flags), seconds, ranks, listen, recorder, announce)
    summary = _summarise(session)
    (work / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if live:
        _print_summary(summary)
    return summary


def _summarise(session: Session) -> dict[str, Any]:
    windows, events, runtime = session.windows, session.events, session.runtime
    verdicts: dict[str, int] = {}
    for t in windows:
        for d in t.diagnosis.layers:
            key = d.verdict + (f"/{d.cause}" if d.cause else "")
            verdicts[key] = verdicts.get(key, 0) + 1
    decisions = [e for e in events if e["event"] == "decision"]
    applied = [e for e in events if e["event"] == "plan_applied"]
    return {
        "seconds": runtime["wall_seconds"],
        "ranks": runtime["config"]["ranks"],
        "backend": runtime["config"]["backend"],
        "cpu_binding": runtime.get("cpu_binding"),
        "windows_seen": len(windows),
        "frames_rejected": sum(session.rejected.values()),
        "frames_rejected_by_reason": session.rejected,
        "verdicts": dict(sorted(verdicts.items())),
        "decisions": len(decisions),
        "actions_applied": sum(len(e["layers"]) for e in applied),
        "actions_skipped": sum(1 for e in decisions if e["result"] == "skipped"),
        "plans_applied": len(applied),
        "plans_verified": sum(1 for e in events if e["event"] == "verified"),
        "rollbacks": sum(1 for e in events if e["event"] == "rolled_back"),
        "final_epoch": runtime["epoch"],
        **step_figures(windows, events, int(runtime["config"]["warmup_steps"])),
        "old_map_same_traffic": old_map_figures(events),
        "rebalances": [{k: e.get(k) for k in LEDGER_KEYS} for e in session.ledger],
        "pairs_routed": runtime["pairs_routed"],
        "pairs_dropped": runtime["pairs_dropped"],
        "pairs_lost": runtime["pairs_lost"],
        # The runtime counts pairs; a token is lost only if one of its pairs is, so this bounds it.
        "tokens_lost": runtime["pairs_lost"],
        "agent_cpu_share": session.cpu_share,
        "agent_rss_bytes": session.current_rss,
        "agent_peak_rss_bytes": session.peak_rss,
        "audit_log": session.audit_log,
        "metrics_url": session.metrics_url,
        "folder": str(session.work),
    }


def _fmt(value: float | None, unit: str = "", scale: float = 1.0, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}{unit}"


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The summary as the demo prints it, line by line (the README renders a recorded one)."""
    lines = ["summary"]
    lines.append(f"  windows seen        {s['windows_seen']} ({s['windows_before']} steady before the first plan, "
               f"{s['windows_after']} steady after); frames rejected {s['frames_rejected']}"
               + (f" ({', '.join(f'{k} {v}' for k, v in s['frames_rejected_by_reason'].items())})"
                  if s["frames_rejected"] else ""))
    lines.append("  verdicts            " + ", ".join(f"{k} {v}" for k, v in s["verdicts"].items()))
    lines.append(f"  actions             {s['actions_applied']} applied in {s['plans_applied']} plans "
               f"({s['plans_verified']} verified, {s['rollbacks']} rolled back), {s['actions_skipped']} skipped")
    lines.append(f"  balancedness        {_fmt(s['balancedness_before'])} before -> {_fmt(s['balancedness_after'])} after")
    lines.append(f"  step p50            {_fmt(s['step_p50_before_s'], ' ms', 1e3, 1)} before -> "
               f"{_fmt(s['step_p50_after_s'], ' ms', 1e3, 1)} after (steady state: no migration in the window)")
    lines.append(f"  step p99            {_fmt(s['step_p99_before_s'], ' ms', 1e3, 1)} before -> "
               f"{_fmt(s['step_p99_after_s'], ' ms', 1e3, 1)} after")
    stall = s["migration_stall_s"]
    lines.append(f"  migration stall     {stall['total'] * 1e3:.0f} ms in all ("
               + (", ".join(f"{x * 1e3:.0f}" for x in stall["per_plan"]) or "no plan") + " ms per plan), apart from the above")
    old = s["old_map_same_traffic"]
    if old is not None:
        lines.append(f"  control             old map on the same traffic (agent's model, changed layers): balancedness "
                   f"{_fmt(old['balancedness_old_map_same_load'], '', 1, 3)} vs "
                   f"{_fmt(old['balancedness_after'], '', 1, 3)} measured, layer time "
                   f"{_fmt(old['layer_seconds_old_map_same_load'], '', 1e3, 1)} vs "
                   f"{_fmt(old['layer_seconds_after'], ' ms/step', 1e3, 1)}")
    for entry in s.get("rebalances") or ():  # results recorded before the ledger have none
        lines.append(f"  rebalance ledger    {entry['policy']} {LEDGER_OUTCOMES.get(entry['outcome'], entry['outcome'])}: "
                     + ledger_figures(entry))
    b = s.get("cpu_binding") or {}
    if b.get("warning"):
        lines.append(f"  note                {b['warning']}")
    lines.append(f"  pairs lost          {s['pairs_lost']} of {s['pairs_routed']} routed (dropped by capacity: "
               f"{s['pairs_dropped']})")
    lines.append(f"  agent               {_fmt(s['agent_cpu_share'], '%', 100, 1)} of one core while ingesting, "
               f"RSS {s['agent_rss_bytes'] / 2**20:.0f} MiB (peak {s['agent_peak_rss_bytes'] / 2**20:.0f} MiB)")
    lines.append(f"  audit log           {s['audit_log']}")
    lines.append(f"  metrics             {s['metrics_url']} (served while the demo ran)")
    return lines


def _print_summary(s: dict[str, Any]) -> None:
    click.echo("")
    for line in summary_lines(s):
        click.echo(line)



@click.command(cls=OneLineCommand)
@click.option("--seconds", type=click.FloatRange(5, 3600), default=45.0, show_default=True,
              help="How long the runtime serves (startup and the summary add about 15 s).")
@click.option("--json", "as_json", is_flag=True, help="Print only the summary object as JSON.")
@click.option("--ranks", type=click.IntRange(1, 8), default=None,
              help="EP ranks (default: one per GPU with NCCL, else one per core, 2 to 4, with gloo).")
@click.option("--keep", type=click.Path(file_okay=False), default=None,
              help="Folder for the socket, audit log and windows (default: a temporary folder).")
@click.option("--listen", default="127.0.0.1:0", show_default=True, help="HOST:PORT for the agent's /metrics.")
def demo(seconds: float, as_json: bool, ranks: int, keep: str | None, listen: str) -> dict[str, Any]:
    """Run the reference runtime (a workload whose hot experts drift) and the agent in act mode,
    wired through a socket in a temporary folder; show live verdicts and actions, then a summary."""
    try:
        summary = run_demo(seconds=seconds, ranks=ranks, folder=keep, listen=listen, live=not as_json)
    except ConfigError as exc:
        fail_input(str(exc))
    except DemoError as exc:
        click.echo(f"moewatch: demo failed: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("moewatch: demo interrupted", err=True)
        sys.exit(130)
    if as_json:
        click.echo(json.dumps(summary, indent=1, allow_nan=False))
    return summary


# `--record` writes the summary with its provenance into docs/benchmarks/results/ (the README's summary
# is rendered from such a file); a plain `moewatch demo` writes nothing there.
demo = recorded("demo", demo, opt_in=True)
