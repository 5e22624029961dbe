"""A real Prometheus on loopback scrapes a running agent fed by the reference runtime, with the rule
files loaded; through its HTTP API the agent's series are found and the recording rules evaluated
over them, and no rule fails to evaluate against real series.

    moewatch runtime (2 CPU ranks) --unix socket--> moewatch agent --/metrics--> prometheus (rules)
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml

from moewatch.agent import catalog
from moewatch.planner.placement_math import contiguous_placement

ROOT = Path(__file__).resolve().parents[1]
RULE_FILES = sorted(ROOT.glob("alerts/*.yml"))
DEADLINE_S = 45.0  # first samples take 6 s or more; the runtime's start (torch, 2 ranks) comes first
MODEL, EP_GROUP, LAYERS = "scrape-test", "ep-scrape", 2
# A second group, sent by the test as an engine would: windows carrying the records of its own EPLB
# calling moewatch's policy, so the engine rebalance panels are queried with data.
ENGINE_GROUP = "ep-engine-eplb"
# Dashboard queries allowed to come back empty from a clean run, and why.
EMPTY_IN_A_CLEAN_RUN = {
    "moewatch / agent health / Frames rejected per second / A": "no frame is rejected",
    "moewatch / agent health / Per-expert series left out / A": "per-expert series are off by default",
}

# A third group, sent as two DP ranks' shards would be (docs/deploy.md): the shard panels are queried
# with its data.
SHARD_GROUP = "ep-dp-shards"
SHARD_QUERIES = [f"moewatch / overview / {title} / {ref}"
                 for title, refs in (("Windows merged from shards", "A"), ("Shards missing and refused", "AB"),
                                     ("Ranks disagreeing on a rebalance", "A"))
                 for ref in refs]

ENGINE_REBALANCE_QUERIES = [f"moewatch / overview / {title} / {ref}"
                            for title, refs in (("Engine rebalance calls", "A"), ("Layers per rebalance by outcome", "A"),
                                                ("Slots moved", "A"), ("Predicted balancedness of the latest rebalance", "A"),
                                                ("Predicted stall and call time", "AB"), ("Checked on the next window", "AB"),
                                                ("Steps since the last rebalance", "AB"),
                                                # The rebalance ledger row: the engine group's rebalance, settled.
                                                ("Rebalances by policy and outcome", "A"),
                                                ("Net seconds of the latest rebalance", "A"),
                                                ("Stall and gain per step", "AB"),
                                                ("Break-even against the horizon", "AB"),
                                                ("Measured balancedness and step time around it", "AB"))
                            for ref in refs]

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def moewatch(*args: str) -> list[str]:
    return [sys.executable, "-m", "moewatch.cli", *args]


def runtime_command(sock: Path) -> list[str]:
    # Tiny sizes, a window every 5 steps, running until stopped (the fixture ends it). Capacity factor
    # 1.0 with skewed routing drops pairs, so the capacity series and the drop counters carry values.
    return moewatch("runtime", "--socket", str(sock), "--ranks", "2", "--layers", str(LAYERS), "--experts", "4",
                    "--top-k", "2", "--hidden", "16", "--ffn", "32", "--batch-tokens", "32", "--steps", "0",
                    "--seconds", "120", "--window-steps", "5", "--capacity-factor", "1.0", "--zipf", "1.2",
                    "--model-name", MODEL, "--ep-group", EP_GROUP)


def start(cmd: list[str], log: Path, cwd: Path) -> subprocess.Popen:
    # Its own session, so teardown can stop the runtime's rank processes with it.
    return subprocess.Popen(cmd, cwd=cwd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def load_by_path(relative: str, name: str):
    """A module from its file (dashboards/generate.py is a script; a conftest is not importable by name)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def send_engine_rebalances(sock: Path) -> None:
    """As an engine with moewatch's EPLB policy would: a window, one carrying a decided call that moved
    layer 0 and a fallback, then one whose load leaves layer 0 worse (the next-window check); every
    window says how the engine's rebalancing is configured, so the watchdog panels have data."""
    # tests/agent/conftest.py's FakeRuntime and make_window
    helpers = load_by_path("tests/agent/conftest.py", "moewatch_agent_test_helpers")
    W, L, E, P = 4, 2, 8, 12
    rt = helpers.FakeRuntime(str(sock), world_size=W, num_layers=L, num_experts=E, num_slots=P, model=MODEL,
                             ep_group=ENGINE_GROUP).connect()
    pmap = contiguous_placement(L, E, P)
    even = np.full((L, E), 100, dtype=np.int64)
    skewed = even.copy()
    skewed[0, 0] = 2000
    decided = {"engine": "vllm", "fallback": False, "layers_moved": 1, "layers_kept": 1,
               "layer_outcomes": {"moved": 1, "kept_idle": 1}, "layers_by_reason": {"moved": [0]},
               "experts_moved": 4, "balancedness_before": 0.8, "balancedness_proposed": 0.99,
               "balancedness_after": 0.99, "predicted_gain_seconds": 3.0, "predicted_stall_seconds": 0.02,
               "solve_seconds": 0.01}
    fallback = {"engine": "vllm", "fallback": True, "error": "RuntimeError: injected"}
    # Three windows after the rebalance (the agent's verify.windows): the rebalance ledger settles it.
    for i, (load, records) in enumerate([(even, None), (even, [decided, fallback]), (skewed, None), (skewed, None),
                                         (skewed, None)]):
        w = helpers.make_window(load, pmap, W, start_time=1000.0 + 10 * i, model=MODEL, ep_group=ENGINE_GROUP)
        if records:  # the rebalance's window: its last step stalled
            w = w.replace(step_seconds=w.step_seconds + np.eye(len(w.step_seconds))[-1] * 0.5)
        elif i > 1:  # and the steps after it faster: a gain and a break-even to show
            w = w.replace(step_seconds=np.full(w.steps, 0.5 * float(np.mean(first_steps))))
        if i == 0:
            first_steps = w.step_seconds
        # The engine's rebalancing settings, as the adapter sends them with every window (the watchdog row).
        extra = {**w.extra, "rebalancing": {"interval_steps": 100, "asynchronous": True, "observed": True,
                                            "source": "vllm eplb_config"}}
        if records:
            extra["engine_rebalance"] = records
        w = w.replace(extra=extra)
        rt.send(w)
    rt.sock.close()


def send_shards(sock: Path) -> None:
    """As two DP ranks' processes would: window 0 from both shards (their rebalance digests differ),
    window 1 from shard 0 only, so the agent merges one complete and, at the deadline, one partial."""
    import dataclasses

    helpers = load_by_path("tests/agent/conftest.py", "moewatch_agent_test_helpers")
    W, L, E, P = 4, 2, 8, 12
    pmap = contiguous_placement(L, E, P)
    processes = []
    for index in range(2):
        rt = helpers.FakeRuntime(str(sock), world_size=W, num_layers=L, num_experts=E, num_slots=P, model=MODEL,
                                 ep_group=SHARD_GROUP, capabilities=())
        rt.hello = dataclasses.replace(rt.hello, shard_index=index, shard_count=2, pid=7000 + index)
        processes.append(rt.connect())
    record = {"engine": "vllm", "fallback": False, "layer_outcomes": {"kept_no_better": 2}, "call": 1}
    for sequence, senders in ((0, (0, 1)), (1, (0,))):
        for index in senders:
            w = helpers.make_window(np.full((L, E), 50 + index, dtype=np.int64), pmap, W,
                                    start_time=1000.0 + 10 * sequence, model=MODEL, ep_group=SHARD_GROUP)
            extra = {"shard": {"index": index, "count": 2, "rank": index, "sequence": sequence}}
            if sequence == 0:
                extra["engine_rebalance"] = [{**record, "digest": f"d{index}"}]
            processes[index].send(w.replace(extra=extra))
    for rt in processes:
        rt.sock.close()


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


class Stack:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self.prom_url = f"http://127.0.0.1:{free_port()}"
        self.agent_addr = f"127.0.0.1:{free_port()}"

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text()[-3000:] if path.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"--- {name} (exit {p.poll()}):\n{self.log(name)}" for name, p in self.procs.items())

    def query(self, expr: str) -> list[dict]:
        data = get_json(f"{self.prom_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert data["status"] == "success", data
        return data["data"]["result"]

    def wait_for(self, what: str, probe, deadline: float):
        """Poll probe() until it returns something truthy; fail with every process's log."""
        last = None
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                assert proc.poll() is None, f"{name} exited early while waiting for {what}\n{self.logs()}"
            try:
                last = probe()
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                last = exc
            else:
                if last:
                    return last
            time.sleep(0.5)
        pytest.fail(f"no {what} within {DEADLINE_S:.0f} s (last: {last!r})\n{self.logs()}")


class EngineMetrics:
    """An engine's /metrics with vLLM's names (TTFT and inter-token latency histograms, requests
    running) that grows on every scrape, its first tokens slow (0.1-0.5 s): the agent's SLO source has
    an interval to read each time, and TTFT p99 is over its 200 ms target, so the SLO panels and the
    MoE attribution have series."""

    def __init__(self):
        self.scrapes = 0

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

        self.scrapes += 1
        n = 10.0 * self.scrapes
        labels = ["model_name", "engine"]
        ttft = HistogramMetricFamily("vllm:time_to_first_token_seconds", "ttft", labels=labels)
        ttft.add_metric([MODEL, "0"], [("0.1", 0.0), ("0.5", n), ("+Inf", n)], sum_value=0.3 * n)
        itl = HistogramMetricFamily("vllm:inter_token_latency_seconds", "itl", labels=labels)
        itl.add_metric([MODEL, "0"], [("0.01", 0.0), ("0.1", n), ("+Inf", n)], sum_value=0.05 * n)
        tpot = HistogramMetricFamily("vllm:request_time_per_output_token_seconds", "tpot", labels=labels)
        tpot.add_metric([MODEL, "0"], [("0.01", 0.0), ("0.1", n), ("+Inf", n)], sum_value=0.05 * n)
        running = GaugeMetricFamily("vllm:num_requests_running", "running", labels=labels)
        running.add_metric([MODEL, "0"], 3.0)
        return [ttft, itl, tpot, running]


@pytest.fixture
def engine_url():
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(EngineMetrics())
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield f"http://127.0.0.1:{port}/metrics"
    server.shutdown()


@pytest.fixture
def stack(tmp_path, engine_url):
    s = Stack(tmp_path)
    sock = tmp_path / "agent.sock"
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(p) for p in RULE_FILES],
        "scrape_configs": [{"job_name": "moewatch-agent", "static_configs": [{"targets": [s.agent_addr]}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    try:
        s.procs["agent"] = start(moewatch("agent", "--socket", str(sock), "--listen", s.agent_addr,
                                          "--log.audit-log", str(tmp_path / "audit.jsonl"),
                                          "--slo.endpoints", f"{MODEL}/{EP_GROUP}={engine_url}",
                                          "--slo.poll-seconds", "0.5",
                                          # The tiny runtime's windows hold a few hundred pairs per rank: let
                                          # them measure rank speed, so the speed panel is queried with data.
                                          "--policy.slow-rank-min-pairs", "10"), tmp_path / "agent.log", tmp_path)
        s.procs["prometheus"] = start(
            ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address={s.prom_url.removeprefix('http://')}"], tmp_path / "prometheus.log", tmp_path)
        # The runtime connects as a client: start it once the agent's socket exists.
        s.wait_for("agent socket", lambda: sock.exists(), time.monotonic() + 30)
        s.procs["runtime"] = start(runtime_command(sock), tmp_path / "runtime.log", tmp_path)
        send_engine_rebalances(sock)
        send_shards(sock)
        yield s
    finally:
        for proc in reversed(list(s.procs.values())):
            stop(proc)


def test_prometheus_scrapes_the_agent_and_evaluates_the_rules(stack):
    deadline = time.monotonic() + DEADLINE_S
    stack.wait_for("Prometheus ready", lambda: urllib.request.urlopen(f"{stack.prom_url}/-/ready", timeout=2).status == 200,
                   deadline)
    group = f'model="{MODEL}", ep_group="{EP_GROUP}"'

    # The agent's series, scraped: windows are counted and every layer has its gauges.
    windows = stack.wait_for("windows", lambda: [r for r in stack.query(f"moewatch_windows_total{{{group}}}")
                                                 if float(r["value"][1]) >= 2], deadline)
    assert windows[0]["metric"]["job"] == "moewatch-agent"
    shares = stack.query(f"moewatch_layer_a2a_share_ratio{{{group}}}")
    assert sorted(r["metric"]["layer"] for r in shares) == [str(i) for i in range(LAYERS)]
    assert all(0.0 <= float(r["value"][1]) <= 1.0 for r in shares)

    # Recording rules evaluated over them: the verdict code agrees with the raw verdict series. The
    # rule runs on its own clock, so a verdict that changes between the two reads is read again.
    code_of = {"healthy": 0, "comm-bound": 1, "imbalance-bound": 2}

    def verdict_codes():
        codes = stack.query(f"layer:moewatch_layer_verdict:code{{{group}}}")
        raw = {r["metric"]["layer"]: code_of[r["metric"]["verdict"]]
               for r in stack.query(f"moewatch_layer_verdict{{{group}}} == 1")}
        got = {r["metric"]["layer"]: float(r["value"][1]) for r in codes}
        return codes if codes and got == raw else None

    codes = stack.wait_for("layer:moewatch_layer_verdict:code matching moewatch_layer_verdict", verdict_codes,
                           deadline)
    assert sorted(r["metric"]["layer"] for r in codes) == [str(i) for i in range(LAYERS)]
    for r in codes:
        assert set(r["metric"]) == {"__name__", "model", "ep_group", "layer"}  # job/instance aggregated away

    # A rate-based rule needs two scrapes with new windows in between.
    p99 = stack.wait_for("layer:moewatch_layer_a2a_step_seconds:p99_5m", lambda: [
        r for r in stack.query(f"layer:moewatch_layer_a2a_step_seconds:p99_5m{{{group}}}")
        if math.isfinite(float(r["value"][1]))], deadline)
    assert all(0.0 < float(r["value"][1]) < 10.0 for r in p99)
    age = stack.query(f"group:moewatch_last_window:age_seconds{{{group}}}")
    assert len(age) == 1 and -5.0 < float(age[0]["value"][1]) < 30.0
    # Capacity 1.0 drops pairs: the counter-based rules see them, as a share of the routed pairs.
    dropped = stack.wait_for("layer:moewatch_layer_dropped_pairs:rate5m > 0", lambda: stack.query(
        f"layer:moewatch_layer_dropped_pairs:rate5m{{{group}}} > 0"), deadline)
    overflow = stack.query(f"layer:moewatch_layer_overflow_pairs:ratio_rate5m{{{group}}}")
    assert {r["metric"]["layer"] for r in dropped} <= {r["metric"]["layer"] for r in overflow}
    assert all(0.0 < float(r["value"][1]) < 1.0 for r in overflow if r["metric"]["layer"] in
               {d["metric"]["layer"] for d in dropped})

    # Every rule of both files loaded, and none failed to evaluate against the real series.
    def evaluated_rules():
        rules = [r for g in get_json(f"{stack.prom_url}/api/v1/rules")["data"]["groups"] for r in g["rules"]]
        return rules if all(r.get("lastEvaluation", "").startswith("20") for r in rules) else None

    rules = stack.wait_for("every rule evaluated", evaluated_rules, deadline)
    expected = sum(len(g["rules"]) for p in RULE_FILES for g in yaml.safe_load(p.read_text())["groups"])
    assert len(rules) == expected
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []

    # Every name the scrape shows is in the catalogue (the contract the rules and dashboards use).
    names = {r["metric"]["__name__"] for r in stack.query('count by (__name__) ({job="moewatch-agent"})')}
    assert {n for n in names if n.startswith("moewatch_")} <= catalog.exposed_names()

    # Every dashboard query, with its variables set to this run's group, layer 0 and this agent,
    # runs on the real server and, but for the few that a clean run leaves empty, returns series.
    gen = load_by_path("dashboards/generate.py", "moewatch_dashboards_generate")
    values = {"model": MODEL, "ep_group": EP_GROUP, "layer": "0", "instance": stack.agent_addr,
              "__rate_interval": "30s", "__range": "1m", "__interval": "2s"}
    # The engine group's series: counters and gauges the agent set once its three windows were triaged.
    engine_values = {**values, "ep_group": ENGINE_GROUP}
    stack.wait_for("the engine group's next-window check", lambda: stack.query(
        f'moewatch_engine_rebalance_verdicts_total{{model="{MODEL}", ep_group="{ENGINE_GROUP}"}} > 0'), deadline)

    def runs_with_series(expr: str, of: dict) -> bool:
        return bool(stack.query(gen._VARIABLE.sub(lambda m: of[next(g for g in m.groups() if g)], expr)))

    # The sharded group's: a complete window, a partial one at the deadline, the digests that differ.
    shard_values = {**values, "ep_group": SHARD_GROUP}
    shard_group = f'model="{MODEL}", ep_group="{SHARD_GROUP}"'
    stack.wait_for("the sharded group's partial window", lambda: stack.query(
        f'moewatch_shard_windows_total{{{shard_group}, outcome="partial"}} > 0'), deadline)
    empty, engine_only, shard_only = [], [], []
    for name in gen.DASHBOARDS:
        board = json.loads((ROOT / "dashboards" / "json" / name).read_text())
        for where, expr in gen.dashboard_queries(board):
            if runs_with_series(expr, values):
                continue
            if runs_with_series(expr, engine_values):
                engine_only.append(where)
            else:
                (shard_only if runs_with_series(expr, shard_values) else empty).append(where)
    assert set(empty) <= set(EMPTY_IN_A_CLEAN_RUN), empty
    # Only the shard row needs the sharded group, and every query of it has its series.
    assert sorted(shard_only) == sorted(SHARD_QUERIES), shard_only
    outcomes = {r["metric"]["outcome"]: float(r["value"][1])
                for r in stack.query(f"moewatch_shard_windows_total{{{shard_group}}}")}
    assert outcomes == {"complete": 1.0, "partial": 1.0}
    assert [float(r["value"][1]) for r in stack.query(f"moewatch_shards_missing_total{{{shard_group}}}")] == [1.0]
    assert [float(r["value"][1]) for r in stack.query(
        f"moewatch_engine_rebalance_digest_mismatches_total{{{shard_group}}}")] == [1.0]
    # Only the engine rebalance row needs the engine group, and every query of it has its series.
    assert set(engine_only) <= set(ENGINE_REBALANCE_QUERIES), engine_only
    overview = json.loads((ROOT / "dashboards" / "json" / "overview.json").read_text())
    engine_row = {where: expr for where, expr in gen.dashboard_queries(overview) if where in ENGINE_REBALANCE_QUERIES}
    assert sorted(engine_row) == sorted(ENGINE_REBALANCE_QUERIES)
    assert [where for where, expr in engine_row.items() if not runs_with_series(expr, engine_values)] == []
    # and what they show is what the engine's records said: one call decided, one fallback, 4 slots,
    # layer 0 worse on the next window
    calls = {r["metric"]["result"]: float(r["value"][1]) for r in stack.query(
        f'moewatch_engine_rebalance_calls_total{{model="{MODEL}", ep_group="{ENGINE_GROUP}"}}')}
    assert calls == {"decided": 1.0, "fallback": 1.0}
    worse = stack.query(f'moewatch_engine_rebalance_verdicts_total{{model="{MODEL}", ep_group="{ENGINE_GROUP}", '
                        f'verdict="worse"}}')
    assert [float(r["value"][1]) for r in worse] == [1.0]

