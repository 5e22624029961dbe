"""/metrics against the catalogue (every family, nothing else), promtool lint, per-expert cap, OTel."""

from __future__ import annotations

import dataclasses
import subprocess

import numpy as np
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from moewatch.agent.catalog import METRICS, exposed_names
from moewatch.agent.exporters import family_names, sample_names
from moewatch.agent.metrics.state import HistogramValue
from moewatch.agent.otel import instrument_name
from moewatch.tools.examples import SCENARIOS, simulate

PROMTOOL = "promtool"  # found on PATH (make system-deps installs it)


def drive(daemon, helpers, n_windows=3):
    """Windows of every verdict's scenario into one group, plus a rejected frame and a heartbeat."""
    from moewatch import wire

    rt = helpers.FakeRuntime(daemon.cfg.server.socket, world_size=4, num_layers=4, num_experts=16, num_slots=16,
                             model="example", ep_group="example").connect()
    group = helpers.wait_group(daemon, ("example", "example"))
    names = ["imbalance-hot-experts", "comm-bound-volume", "overflow"][:n_windows]
    for i, name in enumerate(names):
        w = simulate(SCENARIOS[name], seed=i, start_time=1000.0 + 100 * i).replace(model="example")
        # the engine's rebalancing settings, in each of its windows (the agent watches its rebalances)
        w = w.replace(extra={**w.extra, "rebalancing": {"interval_steps": 3000, "asynchronous": True, "observed": True}})
        if i == 0:  # what an engine's rebalance with moewatch's EPLB policy reports in its window
            w = w.replace(extra={**w.extra, "engine_rebalance": [ENGINE_REBALANCE]})
        rt.send(w)
    rt.send(wire.Heartbeat(time=1.0, epoch=0, step=1, frames_dropped=1))
    rt.send_raw(b"MW\x01\x05\x02\x00\x00\x00{]")
    assert helpers.wait_for(lambda: len(group.history) == len(names))
    # The malformed frame is counted by the receiver on its own thread: wait for it too.
    assert helpers.wait_for(lambda: daemon.metrics.get("moewatch_frames_rejected_total", ("malformed",)) == 1)
    # One DP rank's process of a sharded group says hello: the shard merge's series start at 0.
    dp = helpers.FakeRuntime(daemon.cfg.server.socket, world_size=4, num_layers=4, num_experts=16, num_slots=16,
                             model="example", ep_group="example-dp", capabilities=())
    dp.hello = dataclasses.replace(dp.hello, shard_index=0, shard_count=2)
    dp.connect()
    assert helpers.wait_for(lambda: daemon.metrics.get("moewatch_shard_sequences_pending", ("example", "example-dp"))
                            == 0)
    rt.shard_process = dp  # kept open with the runtime
    return rt


LEDGER_WINDOWS = 4


def drive_ledger(daemon, helpers, rt):
    """After drive's windows, LEDGER_WINDOWS more of its last kind into its group: an engine rebalance in
    the first, the steps of the three after it twice as fast, so the rebalance ledger settles it and its
    families carry samples."""
    group = daemon.store.get(("example", "example"))
    first = len(group.history)
    for i in range(LEDGER_WINDOWS):
        w = simulate(SCENARIOS["overflow"], seed=10 + i, start_time=2000.0 + 100 * i).replace(model="example")
        w = w.replace(extra={**w.extra, "rebalancing": {"interval_steps": 3000, "asynchronous": True, "observed": True}})
        if i == 0:
            w = w.replace(extra={**w.extra, "engine_rebalance": [
                {"engine": "vllm", "policy": "engine", "layers_changed": [0], "slots_moved": 2}]})
        else:
            w = w.replace(step_seconds=w.step_seconds * 0.5)
        rt.send(w)
    assert helpers.wait_for(lambda: len(group.history) == first + LEDGER_WINDOWS)
    assert helpers.wait_for(lambda: daemon.ledgers.status(group.key) is not None)


ENGINE_REBALANCE = {"engine": "vllm", "layer_outcomes": {"moved": 3, "kept_not_paying": 1}, "experts_moved": 9,
                    "balancedness_before": 0.6, "balancedness_proposed": 0.97, "balancedness_after": 0.95,
                    "predicted_stall_seconds": 0.2, "solve_seconds": 0.05}


class GrowingEngineMetrics:
    """An engine's /metrics (vLLM's TTFT and inter-token histograms, its request gauges) that grows by
    ten slow first tokens and ten tokens on every scrape: every SLO interval has observations."""

    def __init__(self):
        self.scrapes = 0

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

        self.scrapes += 1
        n = 10.0 * self.scrapes
        ttft = HistogramMetricFamily("vllm:time_to_first_token_seconds", "ttft", labels=["model_name", "engine"])
        ttft.add_metric(["example", "0"], [("0.1", 0.0), ("0.5", n), ("+Inf", n)], sum_value=0.4 * n)
        itl = HistogramMetricFamily("vllm:inter_token_latency_seconds", "itl", labels=["model_name", "engine"])
        itl.add_metric(["example", "0"], [("0.01", 0.0), ("0.1", n), ("+Inf", n)], sum_value=0.05 * n)
        running = GaugeMetricFamily("vllm:num_requests_running", "running", labels=["model_name", "engine"])
        running.add_metric(["example", "0"], 3.0)
        return [ttft, itl, running]


@pytest.fixture
def engine_metrics_url():
    """The URL of an engine's /metrics (GrowingEngineMetrics) served on 127.0.0.1."""
    import socket

    from prometheus_client import CollectorRegistry, start_http_server

    engine = CollectorRegistry()
    engine.register(GrowingEngineMetrics())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, _ = start_http_server(port, addr="127.0.0.1", registry=engine)
    yield f"http://127.0.0.1:{port}/metrics"
    server.shutdown()


def start_with_slo(start_agent, helpers, url, **sections):
    """An agent scraping the engine's SLO signals for the group `drive` feeds; returned once the
    first interval (two scrapes) is in, so every window carries the SLO signals."""
    daemon = start_agent(slo={"endpoints": f"example/example={url}", "poll_seconds": 0.1}, **sections)
    assert helpers.wait_for(lambda: daemon.sources["slo"].latest(("example", "example")) is not None)
    return daemon


def test_live_metrics_match_the_catalogue_and_pass_promtool(start_agent, helpers, engine_metrics_url):
    daemon = start_with_slo(start_agent, helpers, engine_metrics_url,
                            exporters={"expert_metrics": True, "expert_series_cap": 20})
    drive_ledger(daemon, helpers, drive(daemon, helpers))
    assert helpers.wait_for(lambda: daemon.metrics.get("moewatch_frames_rejected_total", ("malformed",)) == 1)
    text = helpers.scrape(daemon.http_url)
    assert family_names(text) == {m.name for m in METRICS}
    assert set(sample_names(text)) <= exposed_names()
    # Every family carries samples in this run (the per-expert ones because they are enabled).
    missing = {m.name for m in METRICS} - {n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
                                           for n in sample_names(text)}
    assert missing == set(), missing
    lint = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert lint.stdout.strip() == "" and lint.stderr.strip() == ""
    # The cap: 4 layers x 16 experts = 64 series, 20 exported, 44 counted as left out.
    assert text.count("moewatch_expert_pairs_total{") == 20
    assert helpers.sample_value(text, "moewatch_expert_series_dropped", model="example") == 44
    # No _created series, nothing of the default registry.
    assert "_created" not in text and "python_gc" not in text and "process_" not in text
    # Per-layer verdict: the layer had three verdicts; only the latest is 1.
    verdict_lines = [ln for ln in text.splitlines() if ln.startswith('moewatch_layer_verdict{') and 'layer="0"' in ln]
    assert sum(float(ln.rsplit(" ", 1)[1]) for ln in verdict_lines) == 1
    assert len(verdict_lines) >= 2
    assert helpers.sample_value(text, "moewatch_agent_mode", mode="observe") == 1
    assert helpers.sample_value(text, "moewatch_windows_total", model="example") == 3 + LEDGER_WINDOWS
    # The engine's SLO signals beside the MoE verdicts: TTFT p99 in (0.1, 0.5], breached (target 200 ms).
    ttft = helpers.sample_value(text, "moewatch_slo_latency_seconds", model="example", signal="ttft",
                                percentile="p99")
    assert ttft == pytest.approx(0.1 + 0.4 * 0.99)
    assert helpers.sample_value(text, "moewatch_slo_breached", model="example", slo="ttft_p99") == 1
    assert helpers.sample_value(text, "moewatch_slo_target_seconds", model="example", slo="ttft_p99") == 0.2


def test_slo_interval_reaches_metrics_without_a_window(start_agent, helpers, engine_metrics_url):
    """An engine that went idle sends no window: its last interval's latencies show all the same, at
    the next scrape of its /metrics (the breach too; the MoE attribution waits for a window)."""
    daemon = start_with_slo(start_agent, helpers, engine_metrics_url)
    group = {"model": "example", "ep_group": "example"}

    def ttft_p99():
        return helpers.sample_value(helpers.scrape(daemon.http_url), "moewatch_slo_latency_seconds", **group,
                                    signal="ttft", percentile="p99")

    assert helpers.wait_for(lambda: ttft_p99() is not None)
    text = helpers.scrape(daemon.http_url)
    assert daemon.store.get(("example", "example")) is None  # no window came
    assert helpers.sample_value(text, "moewatch_slo_latency_seconds", **group, signal="ttft",
                                percentile="p99") == pytest.approx(0.1 + 0.4 * 0.99)
    assert helpers.sample_value(text, "moewatch_slo_latency_seconds", **group, signal="itl",
                                percentile="p50") == pytest.approx(0.01 + 0.09 * 0.5)
    assert helpers.sample_value(text, "moewatch_slo_requests", **group, state="running") == 3
    assert helpers.sample_value(text, "moewatch_slo_breached", **group, slo="ttft_p99") == 1
    assert helpers.sample_value(text, "moewatch_slo_moe_explained", **group) is None


def test_expert_metrics_off_by_default(start_agent, helpers):
    daemon = start_agent()
    drive(daemon, helpers, 1)
    text = helpers.scrape(daemon.http_url)
    assert "moewatch_expert_pairs_total{" not in text
    assert "# TYPE moewatch_expert_pairs_total counter" in text


def test_histogram_buckets_are_upper_inclusive():
    h = HistogramValue((1.0, 2.0))
    h.observe(np.array([0.5, 1.0, 1.5, 2.0, 3.0, np.nan]))
    assert h.cumulative() == [("1.0", 2.0), ("2.0", 4.0), ("+Inf", 5.0)]
    assert h.count == 5 and h.total == 8.0


def test_opentelemetry_carries_the_same_quantities(start_agent, helpers, engine_metrics_url):
    reader = InMemoryMetricReader()
    daemon = start_with_slo(start_agent, helpers, engine_metrics_url, otel_readers=[reader])
    drive_ledger(daemon, helpers, drive(daemon, helpers, 3))
    data = reader.get_metrics_data()
    points = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                points[metric.name] = metric
    expected = {instrument_name(m) for m in METRICS if not m.name.startswith("moewatch_expert_")}
    assert expected <= set(points), expected - set(points)
    # Same numbers: the balancedness of layer 0 as Prometheus sees it.
    prom = daemon.metrics.get("moewatch_layer_balancedness_ratio", ("example", "example", "0"))
    otel = [p.value for p in points["moewatch_layer_balancedness_ratio"].data.data_points
            if p.attributes["layer"] == "0"]
    assert otel == [prom]
    hist = points["moewatch_layer_expert_load_share"].data.data_points
    # one observation per expert per layer per window
    assert sum(p.count for p in hist) == (3 + LEDGER_WINDOWS) * 4 * 16


def test_otlp_push_when_an_endpoint_is_configured(start_agent, helpers):
    """With otlp_endpoint set, the agent pushes OTLP/HTTP (protobuf) to it on its interval."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    received = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, self.headers["Content-Type"], body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        daemon = start_agent(exporters={"otlp_endpoint": f"http://127.0.0.1:{server.server_address[1]}/v1/metrics",
                                        "otlp_interval_seconds": 1})
        drive(daemon, helpers, 1)
        assert helpers.wait_for(lambda: any(b"moewatch_layer_balancedness_ratio" in r[2] for r in received),
                                timeout=15)
        path, ctype, _ = received[-1]
        assert path == "/v1/metrics" and ctype == "application/x-protobuf"
        daemon.stop()  # the final push still finds the collector
    finally:
        server.shutdown()
