"""The /metrics source against SGLang's own heatmap collector (ExpertDispatchCollector, in
prometheus-client's default registry as SGLang uses it), served over HTTP on 127.0.0.1: two
scrapes, then a restart that resets the counters."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from prometheus_client import REGISTRY, start_http_server

from moewatch.sources import SourceError
from moewatch.sources.sglang_metrics import HeatmapScraper, diff, parse_heatmap

L, W = 3, 4


def record(collector, gpu_physical_count: np.ndarray) -> None:
    """What SGLang's `_handle_metric_eplb_heatmap` does with one sampled pass [L, W]
    (python/sglang/srt/eplb/expert_distribution.py): bucket r gains rank r's pairs."""
    for layer in range(gpu_physical_count.shape[0]):
        hist = collector.eplb_gpu_physical_count.labels(layer=str(layer))
        for rank, count in enumerate(gpu_physical_count[layer]):
            if count > 0:
                hist._sum.inc(int(count) * rank)
                hist._buckets[rank].inc(int(count))


@pytest.fixture
def sglang_server():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.observability.metrics_collector import ExpertDispatchCollector
    server, thread = start_http_server(0, addr="127.0.0.1", registry=REGISTRY)
    state = {"collector": ExpertDispatchCollector(W)}

    def restart():
        REGISTRY.unregister(state["collector"].eplb_gpu_physical_count)
        state["collector"] = ExpertDispatchCollector(W)

    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        yield url, state, restart
    finally:
        REGISTRY.unregister(state["collector"].eplb_gpu_physical_count)
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.slow
def test_two_scrapes_and_a_reset(sglang_server):
    url, state, restart = sglang_server
    now = [100.0]
    scraper = HeatmapScraper(url, clock=lambda: now[0])
    rng = np.random.default_rng(0)
    first, second, third = (rng.integers(1, 50, size=(L, W)) for _ in range(3))
    record(state["collector"], first)
    assert scraper.scrape() is None  # the baseline
    record(state["collector"], second)
    record(state["collector"], second)
    now[0] = 110.0
    window = scraper.scrape()
    assert np.array_equal(window.load, 2 * second) and not window.reset
    assert (window.start_time, window.end_time) == (100.0, 110.0)
    expected = (2 * second).mean(axis=1) / (2 * second).max(axis=1)
    assert np.allclose(window.balancedness, expected)
    restart()  # SGLang restarted (e.g. to load a new placement): its counters start from zero
    record(state["collector"], third)
    now[0] = 120.0
    after = scraper.scrape()
    assert after.reset and np.array_equal(after.load, third)
    assert scraper.scrape() is None  # nothing new


def test_exposition_without_the_heatmap_is_none():
    assert parse_heatmap('# TYPE sglang:num_requests_total counter\nsglang:num_requests_total 3.0\n') is None


def test_buckets_that_are_not_ranks_are_refused():
    text = ('# TYPE sglang:eplb_gpu_physical_count histogram\n'
            'sglang:eplb_gpu_physical_count_bucket{layer="0",le="0.5"} 1.0\n'
            'sglang:eplb_gpu_physical_count_bucket{layer="0",le="+Inf"} 1.0\n'
            'sglang:eplb_gpu_physical_count_count{layer="0"} 1.0\n'
            'sglang:eplb_gpu_physical_count_sum{layer="0"} 0.0\n')
    with pytest.raises(SourceError, match="not the ranks"):
        parse_heatmap(text)


def test_layer_that_went_down_counts_whole():
    before = np.array([[5, 5], [7, 7]])
    after = np.array([[6, 9], [1, 2]])
    delta = diff(before, after, 0.0, 1.0)
    assert delta.load.tolist() == [[1, 4], [1, 2]] and delta.reset


def test_unreachable_url_is_a_source_error():
    scraper = HeatmapScraper("http://127.0.0.1:9/metrics", timeout_seconds=0.5)
    with pytest.raises(SourceError, match="scrape failed"):
        scraper.scrape()
