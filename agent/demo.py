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
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import click
import numpy as np

from .config import build_config
from .store import GroupStore, TriagedWindow

# The demo's EP group: small enough for 4 ranks on 2 cores, with spare slots to replicate into.
DEMO_RUNTIME = {
    "layers": 4, "experts": 16, "slots": 24, "top-k": 2, "hidden": 128, "ffn": 512, "batch-tokens": 256,
    "workload": "drift", "hot-experts": 2, "hot-share": 0.5, "zipf": 0.0, "drift-every": 250,
    "window-steps": 10, "model-name": "demo", "ep-group": "ep0",
}
# The agent reacts in seconds (a production default is minutes): the demo's drift comes every ~15 s.
DEMO_AGENT = {
    "mode": "act", "persist_windows": 6, "verify_windows": 3, "plan_interval_seconds": 1.0,
    "triage_interval_seconds": 0.2, "export_interval_seconds": 1.0, "cooldown_seconds": 8.0,
    "max_plans_per_hour": 120, "horizon_seconds": 300.0, "history_windows": 256,
    # The demo's experts are 128 x 512 float32 (x3 matrices), moved over shared memory.
    "expert_bytes": 3 * 128 * 512 * 4, "migration_bandwidth_bytes_per_second": 1e9,
}


class DemoError(Exception):
    pass


def _short(verdict: str, cause: str | None) -> str:
    v = {"healthy": "ok", "comm-bound": "comm", "imbalance-bound": "imbal"}[verdict]
    return v if not cause else f"{v}/{cause}"


def _colour(text: str, verdict: str, enabled: bool) -> str:
    if not enabled:
        return text
    return click.style(text, fg={"healthy": "green", "comm-bound": "yellow", "imbalance-bound": "red"}[verdict])


class _Recorder:
    """Collects what the summary needs from the agent's window and audit callbacks."""

    def __init__(self, live: bool, started: float):
        self.live = live
        self.started = started
        self.colour = live and sys.stdout.isatty()
        self.windows: list[TriagedWindow] = []
        self.events: list[dict[str, Any]] = []
        self.first_window_at: tuple[float, resource.struct_rusage] | None = None
        self.last_window_at: tuple[float, resource.struct_rusage] | None = None
        self.lock = threading.Lock()
        self._last_skip: dict[tuple, str] = {}

    def _print(self, text: str) -> None:
        if self.live:
            click.echo(f"[{time.monotonic() - self.started:6.1f}s] {text}")

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
        elif event in ("verified", "rollback", "rolled_back", "plan_failed", "plan_invalid"):
            self._print(f"  {event}: epoch {entry.get('epoch')} {entry.get('reason') or entry.get('error') or ''}")


def _runtime_command(socket_path: str, seconds: float, ranks: int) -> list[str]:
    cmd = [sys.executable, "-m", "moewatch.cli", "runtime", "--ranks", str(ranks), "--steps", "0",
           "--seconds", f"{seconds:g}", "--socket", socket_path, "--json"]
    for key, value in DEMO_RUNTIME.items():
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


def _steps(windows: list[TriagedWindow]) -> np.ndarray:
    return np.concatenate([t.window.step_seconds for t in windows]) if windows else np.array([])


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def run_demo(seconds: float = 60.0, ranks: int = 4, folder: str | None = None, listen: str = "127.0.0.1:0",
             live: bool = True) -> dict[str, Any]:
    from .daemon import Daemon

    work = Path(folder) if folder else Path(tempfile.mkdtemp(prefix="moewatch-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    socket_path = str(work / "agent.sock")
    if len(socket_path.encode()) > 100:  # sun_path holds 108 bytes
        raise DemoError(f"--keep: {work} is too long a path for a unix socket inside it")
    cfg = build_config(flags={**DEMO_AGENT, "socket": socket_path, "listen": listen,
                              "audit_log": str(work / "audit.jsonl")}, environ={})
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("apscheduler").setLevel(logging.ERROR)
    started = time.monotonic()
    recorder = _Recorder(live, started)
    daemon = Daemon(cfg)
    daemon.window_listeners.append(recorder.on_window)
    daemon.start()
    daemon.controller.listeners.append(recorder.on_event)
    metrics_url = daemon.http_url + "/metrics"
    cmd = _runtime_command(socket_path, seconds, ranks)
    if live:
        click.echo(f"moewatch demo: reference runtime on {ranks} CPU ranks ({DEMO_RUNTIME['layers']} layers, "
                   f"{DEMO_RUNTIME['experts']} experts in {DEMO_RUNTIME['slots']} slots, {DEMO_RUNTIME['hot-experts']} "
                   f"hot experts carrying {DEMO_RUNTIME['hot-share']:.0%} of pairs, moving every "
                   f"{DEMO_RUNTIME['drift-every']} steps) for {seconds:g} s; agent in act mode")
        click.echo(f"  folder {work}\n  metrics {metrics_url}\n  audit log {cfg.audit_log}")
        click.echo("  starting the runtime's ranks (torch import and gloo setup take a few seconds)...")
    log_path = work / "runtime.log"
    try:
        with open(log_path, "w", encoding="utf-8") as log_file:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log_file, text=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=seconds + 300)
        if proc.returncode != 0:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise DemoError(f"the runtime exited {proc.returncode}: {' / '.join(tail)} (log: {log_path})")
        try:
            runtime = json.loads(proc.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            raise DemoError(f"the runtime printed no result (log: {log_path})") from None
        # The last windows may still be in the triage job's queue.
        group = daemon.store.get((DEMO_RUNTIME["model-name"], DEMO_RUNTIME["ep-group"]))
        deadline = time.monotonic() + 5
        while group is not None and group.untriaged and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2 * cfg.triage_interval_seconds)
        current_rss, peak_rss = _rss_bytes()
        summary = _summarise(recorder, runtime, daemon, cfg, work, metrics_url, current_rss, peak_rss)
    except subprocess.TimeoutExpired:
        raise DemoError(f"the runtime did not finish within {seconds + 300:g} s (log: {log_path})") from None
    finally:
        daemon.stop()
    (work / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if live:
        _print_summary(summary)
    return summary


def _summarise(rec: _Recorder, runtime: dict[str, Any], daemon, cfg, work: Path, metrics_url: str,
               current_rss: int, peak_rss: int) -> dict[str, Any]:
    with rec.lock:
        windows = list(rec.windows)
        events = list(rec.events)
        first, last = rec.first_window_at, rec.last_window_at
    start_epoch = windows[0].window.epoch if windows else 0
    before = [t for t in windows if t.window.epoch == start_epoch]
    after = [t for t in windows if t.window.epoch > start_epoch]
    verdicts: dict[str, int] = {}
    for t in windows:
        for d in t.diagnosis.layers:
            key = d.verdict + (f"/{d.cause}" if d.cause else "")
            verdicts[key] = verdicts.get(key, 0) + 1
    decisions = [e for e in events if e["event"] == "decision"]
    applied = [e for e in events if e["event"] == "plan_applied"]
    ingest_wall = (last[0] - first[0]) if first and last and last[0] > first[0] else None
    cpu_share = (_cpu(last[1]) - _cpu(first[1])) / ingest_wall if ingest_wall else None
    steps_before, steps_after = _steps(before), _steps(after)
    rejected = {labels[0]: int(v) for labels, v in daemon.metrics.series("moewatch_frames_rejected_total")}
    return {
        "seconds": runtime["wall_seconds"],
        "ranks": runtime["config"]["ranks"],
        "windows_seen": len(windows),
        "frames_rejected": sum(rejected.values()),
        "frames_rejected_by_reason": rejected,
        "verdicts": dict(sorted(verdicts.items())),
        "decisions": len(decisions),
        "actions_applied": sum(len(e["layers"]) for e in applied),
        "actions_skipped": sum(1 for e in decisions if e["result"] == "skipped"),
        "plans_applied": len(applied),
        "plans_verified": sum(1 for e in events if e["event"] == "verified"),
        "rollbacks": sum(1 for e in events if e["event"] == "rolled_back"),
        "final_epoch": runtime["epoch"],
        "windows_before": len(before),
        "windows_after": len(after),
        "balancedness_before": _mean_balancedness(before),
        "balancedness_after": _mean_balancedness(after),
        "step_p50_before_s": _pct(steps_before, 50),
        "step_p50_after_s": _pct(steps_after, 50),
        "step_p99_before_s": _pct(steps_before, 99),
        "step_p99_after_s": _pct(steps_after, 99),
        "migration_stall_s": [a.get("stall_seconds") for a in applied],
        "pairs_routed": runtime["pairs_routed"],
        "pairs_dropped": runtime["pairs_dropped"],
        "pairs_lost": runtime["pairs_lost"],
        # The runtime counts pairs; a token is lost only if one of its pairs is, so this bounds it.
        "tokens_lost": runtime["pairs_lost"],
        "agent_cpu_share": cpu_share,
        "agent_rss_bytes": current_rss,
        "agent_peak_rss_bytes": peak_rss,
        "audit_log": str(cfg.audit_log),
        "metrics_url": metrics_url,
        "folder": str(work),
    }


def _fmt(value: float | None, unit: str = "", scale: float = 1.0, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}{unit}"


def _print_summary(s: dict[str, Any]) -> None:
    click.echo("")
    click.echo("summary")
    click.echo(f"  windows seen        {s['windows_seen']} ({s['windows_before']} before the first plan, "
               f"{s['windows_after']} after); frames rejected {s['frames_rejected']}"
               + (f" ({', '.join(f'{k} {v}' for k, v in s['frames_rejected_by_reason'].items())})"
                  if s["frames_rejected"] else ""))
    click.echo("  verdicts            " + ", ".join(f"{k} {v}" for k, v in s["verdicts"].items()))
    click.echo(f"  actions             {s['actions_applied']} applied in {s['plans_applied']} plans "
               f"({s['plans_verified']} verified, {s['rollbacks']} rolled back), {s['actions_skipped']} skipped")
    click.echo(f"  balancedness        {_fmt(s['balancedness_before'])} before -> {_fmt(s['balancedness_after'])} after")
    click.echo(f"  step p50            {_fmt(s['step_p50_before_s'], ' ms', 1e3, 1)} before -> "
               f"{_fmt(s['step_p50_after_s'], ' ms', 1e3, 1)} after")
    click.echo(f"  step p99            {_fmt(s['step_p99_before_s'], ' ms', 1e3, 1)} before -> "
               f"{_fmt(s['step_p99_after_s'], ' ms', 1e3, 1)} after")
    click.echo(f"  pairs lost          {s['pairs_lost']} of {s['pairs_routed']} routed (dropped by capacity: "
               f"{s['pairs_dropped']})")
    click.echo(f"  agent               {_fmt(s['agent_cpu_share'], '%', 100, 1)} of one core while ingesting, "
               f"RSS {s['agent_rss_bytes'] / 2**20:.0f} MiB (peak {s['agent_peak_rss_bytes'] / 2**20:.0f} MiB)")
    click.echo(f"  audit log           {s['audit_log']}")
    click.echo(f"  metrics             {s['metrics_url']} (served while the demo ran)")
