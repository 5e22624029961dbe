"""The /metrics source against SGLang's own heatmap (tests/sources/conftest.py, `sglang_heatmap`): two
scrapes, then a restart that resets the counters; each difference is a Window of per-rank totals."""

from __future__ import annotations

import numpy as np
import pytest

from moewatch.integrations.base import SourceError
from moewatch.integrations.sglang.heatmap import (
    HeatmapScraper,
    RankLoad,
    default_placement,
    diff,
    heatmap_window,
    parse_heatmap,
)
from moewatch.triage import diagnose

L, W, E = 3, 4, 8


@pytest.mark.slow
def test_two_scrapes_and_a_reset(sglang_heatmap):
    url, record, restart = sglang_heatmap
    now = [100.0]
    scraper = HeatmapScraper(url, clock=lambda: now[0])
    rng = np.random.default_rng(0)
    first, second, third = (rng.integers(1, 50, size=(L, W)) for _ in range(3))
    second[0] = [400, 10, 10, 10]  # layer 0: rank 0 carries most pairs
    record(first)
    assert scraper.scrape() is None  # the baseline
    record(second)
    record(second)
    now[0] = 110.0
    sample = scraper.scrape()
    assert np.array_equal(sample.load, 2 * second) and not sample.reset
    assert (sample.start_time, sample.end_time) == (100.0, 110.0)
    expected = (2 * second).mean(axis=1) / (2 * second).max(axis=1)
    assert np.allclose(sample.balancedness, expected)
    window = heatmap_window(sample, default_placement(L, E), model="m", ep_group="g", label=url)
    assert window.runtime == "sglang" and (window.model, window.ep_group) == ("m", "g")
    assert np.array_equal(window.rank_tokens, 2 * second) and window.expert_tokens is None
    assert (window.world_size, window.num_slots, window.steps) == (W, E, 0)
    assert (window.start_time, window.end_time) == (100.0, 110.0) and window.step_seconds is None
    assert "expert_load" in window.missing_evidence and "rank_load" not in window.missing_evidence
    layers = diagnose(window).layers
    assert (layers[0].verdict, layers[0].cause) == ("imbalance-bound", None)
    assert layers[0].metrics["balancedness"] == pytest.approx(expected[0])
    restart()  # SGLang restarted (e.g. to load a new placement): its counters start from zero
    record(third)
    now[0] = 120.0
    after = scraper.scrape()
    assert after.reset and np.array_equal(after.load, third)
    again = heatmap_window(after, default_placement(L, E), label=url)
    assert np.array_equal(again.rank_tokens, third) and again.extra["source"]["reset"] is True
    assert again.start_time == 110.0
    assert scraper.scrape() is None  # nothing new


def test_layers_not_sampled_yet_computed_nothing():
    sample = RankLoad(0.0, 1.0, np.array([[5, 1]]), False)
    window = heatmap_window(sample, default_placement(3, 4))
    assert window.rank_tokens.tolist() == [[5, 1], [0, 0], [0, 0]]


@pytest.mark.parametrize("load,pmap,needle", [
    (np.ones((3, 2), int), default_placement(2, 4), "3 layers, but the placement has 2"),
    (np.ones((2, 3), int), default_placement(2, 4), "4 slots do not divide over 3 ranks"),
])
def test_a_heatmap_unlike_the_placement_is_refused(load, pmap, needle):
    with pytest.raises(SourceError, match=needle) as err:
        heatmap_window(RankLoad(0.0, 1.0, load, False), pmap, label="http://h/metrics")
    assert err.value.field == "http://h/metrics"


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
