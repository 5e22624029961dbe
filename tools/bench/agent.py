"""`moewatch bench agent`: what one agent process costs at a given window size and rate.

A real agent (`moewatch agent`, its own process) is fed by a real client over its unix socket: a
hello, then production-size windows (moewatch.tools.examples.production_window) at a fixed rate, while a
scraper reads /metrics the way Prometheus does. Measured on the agent process, from /proc: CPU
seconds per window and the share of one core, resident memory; from the scraper: scrape time; from
/metrics: how many windows the triage had not caught up with at the end. The in-process triage of
one such window is timed separately. Numbers, not assertions: they go into the closing note of the
work that changes them, with the command and the machine's load.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import click
import numpy as np

from moewatch import wire
from moewatch.cli_contract import OneLineCommand

CONTRACT_KEYS = ("cpu_per_window_s", "cpu_share", "rss_mb", "scrape_ms_p50", "triage_ms", "windows_lagging")


def _progress(message: str) -> None:
    click.echo(f"bench agent: {message}", err=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _proc_memory_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":", 1)
            values[key] = int(value.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


def _scrape(url: str) -> tuple[float, bytes]:
    start = time.perf_counter()
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        body = resp.read()
    return (time.perf_counter() - start) * 1e3, body


def _windows_total(body: bytes) -> float:
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith("moewatch_windows_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def triage_ms(window, repeats: int = 7) -> tuple[float, float]:
    """Median wall and CPU milliseconds of the in-process triage of `window` (on a shared machine the
    CPU time is the steadier figure)."""
    from moewatch.triage import diagnose

    diagnose(window)
    wall, cpu = [], []
    for fresh in [window.replace() for _ in range(repeats)]:  # fresh windows: nothing derived cached yet
        start, start_cpu = time.perf_counter(), time.process_time()
        diagnose(fresh)
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


# The link rate the bench's windows declare (400 Gbit/s, a current NIC per GPU): only the bound's
# presence matters to the agent's cost, not its value.
BENCH_LINK_BYTES_PER_SECOND = 50e9


def full_evidence_window(seed: int, **size: Any):
    """A production-size window carrying everything a runtime sends: per-rank timings for every layer,
    the traffic matrix [L][W][W], per-step data (production_window), plus per-rank totals, capacity
    drops (a capacity factor in force; the four hottest experts of each layer lose 1-5 % of their
    pairs, which were routed but never computed) and the all-to-all bound of a runtime that knows its
    link rate (BENCH_LINK_BYTES_PER_SECOND)."""
    from moewatch.telemetry import a2a_lower_bound_seconds, a2a_over_bound
    from moewatch.tools.examples import production_window

    w = production_window(seed, **size)
    rng = np.random.default_rng(seed + 1)
    kept = w.expert_tokens
    hot = np.argsort(-kept, axis=1, kind="stable")[:, :4]
    dropped = np.zeros_like(kept)
    share = rng.uniform(0.01, 0.05, hot.shape)
    np.put_along_axis(dropped, hot, (np.take_along_axis(kept, hot, axis=1) * share).astype(np.int64), axis=1)
    L, W, P = w.num_layers, w.world_size, w.num_slots
    bound = a2a_lower_bound_seconds(w, BENCH_LINK_BYTES_PER_SECOND)
    return w.replace(expert_tokens=kept + dropped, dropped_tokens=dropped, capacity_factor=np.full(L, 1.25),
                     rank_tokens=w.slot_tokens.reshape(L, W, P // W).sum(axis=2), a2a_bound_seconds=bound,
                     a2a_over_bound=a2a_over_bound(w.dispatch_seconds + w.combine_seconds, bound))


PHASES = ("decode", "validate", "derive", "triage", "export", "plan", "scrape")


def phase_cpu_ms(windows: list, repeats: int = 7) -> dict[str, float]:
    """Median CPU milliseconds per window of each step the agent takes, run in this process the way
    the agent runs them: decode (the frame's bytes to arrays, less validation), validate (the reader's
    invariants), derive (the shared derived quantities and per-layer numbers, `layer_metrics`),
    triage (`diagnose` with those cached), export (the window's series and the exposition's re-render),
    plan (the policy's decision in recommend mode on the latest windows) and scrape (one /metrics copy)."""
    from moewatch.agent import policy
    from moewatch.agent.config import build_config
    from moewatch.agent.params import from_config
    from moewatch.agent.exporters import make_registry, render
    from moewatch.agent.metrics.groups import init_group
    from moewatch.agent.metrics.identity import init_static
    from moewatch.agent.metrics.state import MetricsState
    from moewatch.agent.metrics.windows import GroupExportMemory, record_window
    from moewatch.agent.store import TriagedWindow
    from moewatch.telemetry import Window
    from moewatch.triage import diagnose, layer_metrics

    cfg = build_config(environ={}, flags={"policy.mode": "recommend"})
    thresholds = cfg.thresholds
    state = MetricsState(cfg.exporters.expert_series_cap)
    registry = make_registry(state)
    init_static(state, "recommend")
    memory, triaged = GroupExportMemory(), []
    w0 = windows[0]
    init_group(state, (w0.model, w0.ep_group))
    payloads = [wire.encode(w)[wire.HEADER.size:] for w in windows]
    samples: dict[str, list[float]] = {phase: [] for phase in PHASES}

    def timed(phase: str, fn, *args):
        start = time.process_time()
        out = fn(*args)
        samples[phase].append((time.process_time() - start) * 1e3)
        return out

    for i in range(repeats + 2):  # the first two warm caches (label strings, imports) and are not counted
        payload = payloads[i % len(payloads)]
        window = timed("decode", Window.from_bytes, payload)  # decode and validate; validation is taken out below
        timed("validate", window.replace)
        timed("derive", layer_metrics, window, thresholds)
        diagnosis = timed("triage", diagnose, window, thresholds)
        timed("export", record_window, state, memory, window, diagnosis, cfg.exporters.expert_metrics)
        triaged.append(TriagedWindow(window, diagnosis, time.time()))
        view = policy.GroupView(num_gpus=w0.world_size, num_nodes=max(1, w0.world_size // w0.ranks_per_node),
                                num_experts=w0.num_experts, num_slots=w0.num_slots, capabilities=frozenset(),
                                windows=triaged[-cfg.policy.persist_windows:])
        timed("plan", policy.decide, view, from_config(cfg).policy, time.time())
        timed("scrape", render, registry)
    medians = {phase: statistics.median(values[2:]) for phase, values in samples.items()}
    # Reading a frame validates it: decode is what reading costs beyond validating the same fields.
    medians["decode"] = max(medians["decode"] - medians["validate"], 0.0)
    out = {phase: round(ms, 2) for phase, ms in medians.items()}
    out["total"] = round(sum(out[phase] for phase in PHASES if phase != "scrape"), 2)
    return out


def run(layers: int = 58, experts: int = 256, slots: int = 320, ranks: int = 64, top_k: int = 8,
        rate: float = 1.0, seconds: float = 60.0, scrape_interval: float = 1.0, warmup_windows: int = 5,
        mode: str = "observe", seed: int = 0) -> dict[str, Any]:
    """Start an agent, feed it for `seconds` after `warmup_windows`, and measure it."""
    _progress(f"building windows: {layers} layers x {experts} experts, {slots} slots on {ranks} ranks, top-{top_k}, "
              "full evidence")
    windows = [full_evidence_window(seed + i, num_layers=layers, num_experts=experts, num_slots=slots,
                                    world_size=ranks, top_k=top_k) for i in range(2)]
    triage = triage_ms(windows[0])
    _progress("timing each phase in-process")
    phases = phase_cpu_ms(windows)
    with tempfile.TemporaryDirectory(prefix="mwbench-", dir="/tmp") as tmp:
        sock_path, port = str(Path(tmp) / "agent.sock"), _free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "moewatch.cli", "agent", "--socket", sock_path, "--listen", f"127.0.0.1:{port}",
               "--log.audit-log", str(Path(tmp) / "audit.jsonl"), "--mode", mode, "--log.level", "warning"]
        agent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            return _drive(agent, sock_path, url, windows, rate, seconds, scrape_interval, warmup_windows,
                          dict(layers=layers, experts=experts, slots=slots, ranks=ranks, top_k=top_k, rate=rate,
                               seconds=seconds, mode=mode), triage, phases)
        finally:
            agent.terminate()
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()


def _drive(agent: subprocess.Popen, sock_path: str, url: str, windows: list, rate: float, seconds: float,
           scrape_interval: float, warmup_windows: int, config: dict[str, Any], triage: tuple[float, float],
           phases: dict[str, float]) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while not (os.path.exists(sock_path) and _ready(url)):
        if agent.poll() is not None or time.monotonic() > deadline:
            raise click.ClickException(f"the agent did not start: {agent.stderr.read().strip()[-500:]}")
        time.sleep(0.1)
    w0 = windows[0]
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(sock_path)
    client.sendall(wire.encode(wire.Hello(runtime="bench", model=w0.model, ep_group=w0.ep_group,
                                          world_size=w0.world_size, num_layers=w0.num_layers,
                                          num_experts=w0.num_experts, num_slots=w0.num_slots,
                                          ranks_per_node=w0.ranks_per_node, pid=os.getpid())))
    span = w0.end_time - w0.start_time
    sent = 0

    def send_next() -> None:
        nonlocal sent
        start = 1_790_000_000.0 + sent * max(span, 1e-3) * 1.01
        frame = wire.encode(windows[sent % len(windows)].replace(start_time=start, end_time=start + span))
        client.sendall(frame)
        sent += 1

    _progress(f"agent pid {agent.pid} up; {warmup_windows} warm-up windows")
    for _ in range(warmup_windows):
        send_next()
        time.sleep(1.0 / rate)
    while _windows_total(_scrape(url)[1]) < warmup_windows:
        time.sleep(0.2)
    scrapes: list[float] = []
    lag_max = 0.0
    rss: list[float] = []
    stop = threading.Event()
    sent_at_start = sent

    def scraper() -> None:
        nonlocal lag_max
        while not stop.wait(scrape_interval):
            ms, body = _scrape(url)
            scrapes.append(ms)
            lag_max = max(lag_max, sent - _windows_total(body))
            rss.append(_proc_memory_mb(agent.pid)[0])

    thread = threading.Thread(target=scraper, daemon=True)
    cpu0, t0 = _proc_cpu_seconds(agent.pid), time.monotonic()
    load_before = os.getloadavg()
    _progress(f"feeding {rate:g} windows/s for {seconds:g} s, scraping every {scrape_interval:g} s")
    thread.start()
    n = int(round(seconds * rate))
    for i in range(n):
        send_next()
        delay = t0 + (i + 1) / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    cpu1, t1 = _proc_cpu_seconds(agent.pid), time.monotonic()
    stop.set()
    thread.join()
    # Catch-up: a triage interval and a second of grace, then whatever is still untriaged lags.
    time.sleep(2.0)
    _, body = _scrape(url)
    processed = _windows_total(body)
    rss_now, rss_peak = _proc_memory_mb(agent.pid)
    client.close()
    windows_in_run = sent - sent_at_start
    return {
        "cpu_per_window_s": round((cpu1 - cpu0) / max(windows_in_run, 1), 5),
        "cpu_share": round((cpu1 - cpu0) / (t1 - t0), 4),
        "rss_mb": round(max(rss + [rss_now]), 1),
        "scrape_ms_p50": round(statistics.median(scrapes), 2) if scrapes else None,
        "triage_ms": round(triage[0], 2),
        "triage_cpu_ms": round(triage[1], 2),
        "windows_lagging": int(sent - processed),
        "rss_peak_mb": round(rss_peak, 1),
        "scrape_ms_p90": round(float(np.percentile(scrapes, 90)), 2) if scrapes else None,
        "scrape_ms_p99": round(float(np.percentile(scrapes, 99)), 2) if scrapes else None,
        "scrape_ms_max": round(max(scrapes), 2) if scrapes else None,
        "scrapes": len(scrapes),
        "lag_max_windows": int(lag_max),
        "windows_sent": sent,
        "windows_processed": int(processed),
        "metrics_bytes": len(body),
        "frame_bytes": len(wire.encode(windows[0])),
        "phase_cpu_ms": phases,
        "series": sum(1 for line in body.splitlines() if line and not line.startswith(b"#")),
        "wall_seconds": round(t1 - t0, 2),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "config": config,
    }


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@click.command(cls=OneLineCommand)
@click.option("--layers", type=click.IntRange(1, 512), default=58, show_default=True)
@click.option("--experts", type=click.IntRange(1, 4096), default=256, show_default=True)
@click.option("--slots", type=click.IntRange(1, 8192), default=320, show_default=True)
@click.option("--ranks", type=click.IntRange(1, 1024), default=64, show_default=True)
@click.option("--top-k", type=click.IntRange(1, 64), default=8, show_default=True)
@click.option("--rate", type=click.FloatRange(0.05, 100), default=1.0, show_default=True, help="Windows per second.")
@click.option("--seconds", type=click.FloatRange(1, 3600), default=60.0, show_default=True,
              help="How long to feed the agent after the warm-up.")
@click.option("--scrape-interval", type=click.FloatRange(0.1, 60), default=1.0, show_default=True,
              help="Seconds between /metrics scrapes.")
@click.option("--mode", type=click.Choice(["observe", "recommend"]), default="observe", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print only the result object as JSON.")
def agent(layers: int, experts: int, slots: int, ranks: int, top_k: int, rate: float, seconds: float,
          scrape_interval: float, mode: str, as_json: bool) -> dict[str, Any]:
    """CPU, memory, scrape time and lag of a real agent fed production-size windows over its socket."""
    if slots < experts or slots % ranks or top_k > experts:
        from moewatch.commands import fail_input

        fail_input(f"--slots {slots}, --experts {experts}, --ranks {ranks}, --top-k {top_k}: need slots >= experts, "
                   "slots divisible by ranks and top-k <= experts")
    result = run(layers, experts, slots, ranks, top_k, rate, seconds, scrape_interval, mode=mode)
    if as_json:
        click.echo(json.dumps(result, indent=1))
        return result
    for key in CONTRACT_KEYS + ("triage_cpu_ms", "rss_peak_mb", "scrape_ms_p90", "scrape_ms_p99", "lag_max_windows",
                                "windows_sent", "windows_processed", "series", "frame_bytes", "load_average_before"):
        click.echo(f"{key:>22}  {result[key]}")
    click.echo("CPU ms per window, by phase (in-process):")
    for phase, ms in result["phase_cpu_ms"].items():
        click.echo(f"{phase:>22}  {ms}")
    return result
