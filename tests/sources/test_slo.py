"""The engines' SLO signals: quantiles from histogram buckets as PromQL's histogram_quantile computes
them, vLLM's and SGLang's /metrics (fixtures/slo/vllm_metrics.prom, written by the real
prometheus_client with vLLM 0.32.0's names and buckets: see make_vllm_metrics.py; SGLang 0.5.23's
names from sglang/srt/observability/metrics_collector.py, exposed here by prometheus_client), the
SLO section of the triage and the agent's source."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from moewatch import slo
from moewatch.commands import format_summary
from moewatch.integrations.base import SourceError
from moewatch.integrations.slo.histogram import histogram_quantile
from moewatch.integrations.slo.scrape import interval, parse_exposition
from moewatch.integrations.slo.settings import SloSettings, parse_endpoints
from moewatch.integrations.slo.source import SloSource
from moewatch.telemetry import Window
from moewatch.thresholds import ConfigError
from moewatch.triage import diagnose

VLLM_FIXTURE = Path(__file__).parent / "fixtures" / "slo" / "vllm_metrics.prom"
VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
INF = math.inf


def test_histogram_quantile_interpolates_in_the_bucket():
    le, counts = [0.1, 0.2, 0.4, INF], [10, 30, 40, 40]
    assert histogram_quantile(0.5, le, counts) == pytest.approx(0.1 + 0.1 * (20 - 10) / 20)
    assert histogram_quantile(0.1, le, counts) == pytest.approx(0.04)  # first bucket: from 0
    assert histogram_quantile(1.0, le, counts) == pytest.approx(0.4)
    assert histogram_quantile(0.5, list(reversed(le)), list(reversed(counts))) == pytest.approx(0.15)  # any order


def test_histogram_quantile_edge_cases():
    assert histogram_quantile(0.99, [0.1, 0.2, INF], [1, 1, 5]) == 0.2  # in +Inf: the highest finite bound
    assert math.isnan(histogram_quantile(0.5, [0.1, 0.2], [1, 2]))  # no +Inf bucket
    assert math.isnan(histogram_quantile(0.5, [INF], [3]))  # fewer than two buckets
    assert math.isnan(histogram_quantile(0.5, [0.1, INF], [0, 0]))  # no observations
    assert histogram_quantile(-0.1, [0.1, INF], [1, 1]) == -INF
    assert histogram_quantile(1.1, [0.1, INF], [1, 1]) == INF
    assert histogram_quantile(0.5, [0.0, 1.0, INF], [4, 4, 4]) == 0.0  # lowest bound at or under 0
    # A count that goes down is raised to the running maximum (monotonic again).
    assert histogram_quantile(0.5, [0.1, 0.2, INF], [10, 5, 10]) == histogram_quantile(0.5, [0.1, 0.2, INF],
                                                                                       [10, 10, 10])


def test_vllm_exposition_from_prometheus_client():
    exp = parse_exposition(VLLM_FIXTURE.read_text(), now=10.0)
    assert exp.engine == "vllm" and exp.gauges == {"running": 4.0, "waiting": 2.0}
    since_start = interval(None, exp)
    q = since_start["quantiles"]
    # TTFT: 17 at 150 ms, 3 at 450 ms; p99 rank 19.8 in (0.25, 0.5]
    assert q["ttft"]["p99"] == pytest.approx(0.25 + 0.25 * 2.8 / 3)
    assert q["itl"]["p99"] == pytest.approx(0.075 + 0.025 * 7 / 10)
    assert q["tpot"]["p99"] == pytest.approx(0.025 + 0.025 * 19.8 / 20)
    assert since_start["counts"]["ttft"] == 20 and since_start["counts"]["itl"] == 300
    assert since_start["since_start"] is True
    assert slo.breaches(since_start, slo.SloTargets()) == {"ttft_p99": True, "tpot_p99": False}
    assert "ttft" not in parse_exposition(VLLM_FIXTURE.read_text(), 1.0, model_name="other").histograms


def _sglang_registry():
    """SGLang 0.5.23's SLO metrics (metrics_collector.py: TokenizerMetricsCollector,
    SchedulerMetricsCollector), labels as SGLang sets them, made by prometheus_client."""
    reg = CollectorRegistry()
    labels = ["model_name"]
    families = {
        "ttft": Histogram("sglang:time_to_first_token_seconds", "ttft", labels + ["is_streaming"],
                          buckets=(0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400),
                          registry=reg),
        "itl": Histogram("sglang:inter_token_latency_seconds", "itl", labels,
                         buckets=(0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
                                  0.060, 0.080, 0.100, 0.200, 0.400), registry=reg),
        "e2e": Histogram("sglang:e2e_request_latency_seconds", "e2e", labels + ["is_streaming"],
                         buckets=(0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 10, 20, 40), registry=reg),
        "queue": Histogram("sglang:queue_time_seconds", "queue", labels,
                           buckets=(0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 1.0), registry=reg),
    }
    gauges = {"running": Gauge("sglang:num_running_reqs", "running", labels, registry=reg),
              "waiting": Gauge("sglang:num_queue_reqs", "waiting", labels, registry=reg)}
    return reg, families, gauges


def test_sglang_interval_between_scrapes_and_a_restart():
    reg, h, g = _sglang_registry()
    for _ in range(10):
        h["ttft"].labels("ds", "true").observe(0.15)
        h["itl"].labels("ds").observe(0.009)
    g["running"].labels("ds").set(7)
    first = parse_exposition(generate_latest(reg).decode(), now=100.0)
    assert first.engine == "sglang"
    for _ in range(10):
        h["ttft"].labels("ds", "false").observe(0.7)  # another label set: summed
        h["itl"].labels("ds").observe(0.07)
    second = parse_exposition(generate_latest(reg).decode(), now=115.0)
    got = interval(first, second)
    assert (got["start_time"], got["end_time"], got["since_start"]) == (100.0, 115.0, False)
    assert got["counts"]["ttft"] == 10 and got["quantiles"]["ttft"]["p50"] == pytest.approx(0.6 + 0.2 * 5 / 10)
    assert got["quantiles"]["itl"]["p99"] == pytest.approx(0.06 + 0.02 * 9.9 / 10)
    assert got["gauges"]["running"] == 7.0 and "e2e" not in got["quantiles"]  # no series exposed yet
    # SGLang has no TPOT histogram here: the TPOT SLO is judged on the inter-token latency.
    assert slo.per_token_p99(got) == ("itl", got["quantiles"]["itl"]["p99"])
    # A restarted engine (counts went down) counts whole since it started.
    reg2, h2, _ = _sglang_registry()
    h2["ttft"].labels("ds", "true").observe(0.15)
    h2["itl"].labels("ds").observe(0.009)
    restarted = interval(second, parse_exposition(generate_latest(reg2).decode(), now=130.0))
    assert restarted["since_start"] and restarted["counts"]["ttft"] == 1


def test_foreign_exposition_is_refused():
    with pytest.raises(SourceError, match="no vLLM or SGLang"):
        parse_exposition("up 1\n", now=0.0, where="http://x/metrics")


def _window(layer_seconds, slo_extra, expert_tokens=((90, 10, 0, 0),), steps=10):
    L = len(expert_tokens)
    return Window(runtime="vllm", model="m", ep_group="g", world_size=2, ranks_per_node=2, num_layers=L,
                  num_experts=4, num_slots=4, top_k=1, epoch=0, steps=steps, start_time=0.0, end_time=1.0,
                  hidden_bytes=1024, physical_to_logical_map=[[0, 1, 2, 3]] * L, expert_tokens=list(expert_tokens),
                  slot_tokens=list(expert_tokens), capacity_factor=[0.0] * L,
                  layer_seconds=None if layer_seconds is None else [[layer_seconds, layer_seconds]] * L,
                  extra={slo.SLO_KEY: slo_extra})


def _slo_extra(ttft_p99=0.5, itl_p99=0.03, since=None, end=1000.0):
    return {"engine": "vllm", "start_time": end - 15, "end_time": end, "since_start": False,
            "quantiles": {"ttft": {"p50": 0.1, "p90": 0.2, "p99": ttft_p99},
                          "itl": {"p50": 0.02, "p90": 0.025, "p99": itl_p99}},
            "counts": {"ttft": 20, "itl": 300}, "gauges": {"running": 3.0, "waiting": 1.0},
            "targets": slo.SloTargets().to_dict(), "breached_since": since or {}}


def test_slo_section_says_the_moe_evidence_explains_the_breach():
    # Layer 0: 90/10/0/0 pairs over 2 ranks: rank 0 has 100 of 100 -> imbalance-bound, with stake.
    w = _window(0.4, _slo_extra(ttft_p99=0.5, itl_p99=0.06, since={"ttft_p99": 940.0, "tpot_p99": 985.0}))
    d = diagnose(w)
    assert d.layers[0].verdict == "imbalance-bound" and math.isfinite(d.layers[0].seconds_at_stake)
    section = d.summary["slo"]
    assert [b["slo"] for b in section["breached"]] == ["ttft_p99", "tpot_p99"]
    assert section["breached"][0]["breached_for_seconds"] == 60.0
    assert "smaller prefill chunks" in section["breached"][0]["recommendation"]
    assert "lower the concurrency" in section["breached"][1]["recommendation"]
    share = d.layers[0].seconds_at_stake / 0.06
    assert section["moe"]["share_of_itl"] == pytest.approx(share) and share >= 0.2
    assert section["moe"]["explains"] is True and "explains it" in section["moe"]["text"]
    text = format_summary(d)
    assert "ttft_p99 BREACHED for 60 s" in text and "explains it" in text


def test_slo_section_says_the_cause_is_elsewhere():
    # Tiny stake (layer time 1 ms over 10 steps) against a 60 ms inter-token latency.
    d = diagnose(_window(0.001, _slo_extra(ttft_p99=0.1, itl_p99=0.06)))
    moe = d.summary["slo"]["moe"]
    assert moe["explains"] is False and "cause is elsewhere" in moe["text"]
    # Balanced layers: nothing unhealthy, the cause is elsewhere too.
    balanced = diagnose(_window(0.2, _slo_extra(itl_p99=0.06), expert_tokens=((25, 25, 25, 25),)))
    assert balanced.summary["slo"]["moe"]["explains"] is False
    # Without timings the stake is unknown, and so is the explanation.
    unknown = diagnose(_window(None, _slo_extra(itl_p99=0.06)))
    assert unknown.summary["slo"]["moe"]["explains"] is None


def test_no_breach_no_attribution_and_no_slo_without_signals():
    d = diagnose(_window(0.2, _slo_extra(ttft_p99=0.1, itl_p99=0.02)))
    assert d.summary["slo"]["breached"] == [] and d.summary["slo"]["moe"] is None
    assert "SLOs met" in format_summary(d)
    assert diagnose(_window(0.2, None)).summary["slo"] is None


def test_breached_since_is_kept_while_breached():
    targets = slo.SloTargets()
    over, under = _slo_extra(ttft_p99=0.5), _slo_extra(ttft_p99=0.1)
    since = slo.update_breached_since({}, over, targets, now=1000.0)
    assert since == {"ttft_p99": 985.0}  # the interval's start
    assert slo.update_breached_since(since, over, targets, now=1015.0) == since
    assert slo.update_breached_since(since, under, targets, now=1030.0) == {}
    unmeasured = {"quantiles": {}}
    assert slo.update_breached_since(since, unmeasured, targets, now=1030.0) == since


def test_settings_endpoints():
    assert parse_endpoints("m/g=http://127.0.0.1:8000/metrics, m2/g2=http://h:1/metrics") == {
        ("m", "g"): "http://127.0.0.1:8000/metrics", ("m2", "g2"): "http://h:1/metrics"}
    for bad in ("m/g", "mg=http://h/metrics", "m/g=ftp://h/x", "m/g=http://h/a,m/g=http://h/b"):
        with pytest.raises(ConfigError, match="slo.endpoints"):
            SloSettings(endpoints=bad)
    assert SloSettings().targets == slo.SloTargets(0.2, 0.05, 0.2)


def test_source_scrapes_and_stamps_windows(caplog):
    reg, h, g = _sglang_registry()
    now = [100.0]
    source = SloSource(SloSettings(endpoints="m/g=http://engine:30000/metrics", ttft_p99_seconds=0.3),
                       fetch=lambda url, timeout: generate_latest(reg).decode(), clock=lambda: now[0])
    w = _window(0.2, None)
    source.poll(lambda window: pytest.fail("the SLO source makes no windows"))
    assert source.annotate(w) is w  # the baseline scrape gives no interval yet
    for _ in range(10):
        h["ttft"].labels("m", "true").observe(0.5)
        h["itl"].labels("m").observe(0.009)
    now[0] = 115.0
    source.poll(lambda window: None)
    stamped = source.annotate(w)
    assert stamped.extra["slo"]["targets"]["ttft_p99_seconds"] == 0.3
    assert stamped.extra["slo"]["breached_since"] == {"ttft_p99": 100.0}
    section = diagnose(stamped).summary["slo"]
    assert section["engine"] == "sglang" and [b["slo"] for b in section["breached"]] == ["ttft_p99"]
    assert source.status()["groups"][0]["error"] is None
    failing = SloSource(SloSettings(endpoints="m/g=http://engine:30000/metrics"),
                        fetch=lambda url, timeout: (_ for _ in ()).throw(SourceError(url, "cannot scrape")))
    with caplog.at_level(logging.WARNING, logger="moewatch.integrations.slo.source"):
        failing.poll(lambda window: None)
        failing.poll(lambda window: None)
    assert "cannot scrape" in failing.status()["groups"][0]["error"]
    assert sum("cannot scrape" in r.message for r in caplog.records) == 1  # once per outage
    assert np.all(source.annotate(_window(0.2, None, expert_tokens=((1, 1, 1, 1),))).expert_tokens == 1)


def test_diagnose_prints_the_slo_section_from_a_saved_scrape(tmp_path):
    from click.testing import CliRunner

    from moewatch.cli import main

    path = tmp_path / "w.json"
    path.write_text(_window(0.2, None).to_json())
    result = CliRunner().invoke(main, ["diagnose", str(path), "--engine-metrics", str(VLLM_FIXTURE)])
    assert result.exit_code == 0, result.output
    assert "SLO (vllm)" in result.output and "ttft_p99 BREACHED" in result.output
    as_json = CliRunner().invoke(main, ["diagnose", str(path), "--json", "--engine-metrics", str(VLLM_FIXTURE)])
    section = json.loads(as_json.output)["summary"]["slo"]
    assert [b["slo"] for b in section["breached"]] == ["ttft_p99"]
    bad = CliRunner().invoke(main, ["diagnose", str(path), "--engine-metrics", str(tmp_path / "none.prom")])
    assert bad.exit_code == 2 and "--engine-metrics" in bad.output


def test_the_vllm_fixture_is_what_its_generator_writes_with_the_installed_vllm(tmp_path):
    # The fixture's buckets are read from vLLM's own file: a vLLM upgrade that changes them fails here.
    import subprocess

    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: `make vllm-env` builds vLLM's environment"
    out = tmp_path / "vllm_metrics.prom"
    subprocess.run([str(VLLM_PYTHON), str(VLLM_FIXTURE.with_name("make_vllm_metrics.py")), str(out)], check=True,
                   capture_output=True, timeout=120)

    def content(text: str) -> list[str]:  # `_created` samples are the wall time the generator ran
        return [line for line in text.splitlines() if "_created{" not in line]

    assert content(out.read_text()) == content(VLLM_FIXTURE.read_text())
