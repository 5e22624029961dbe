"""`moewatch bench a2a` (tools/bench/a2a.py): its traffics and layout, and one tiny run for real on
emulated links (root, as in CI) with a deadline, rendered like the docs' page."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from click.testing import CliRunner

from moewatch.cli import main
from moewatch.tools.bench import a2a
from moewatch.tools.bench.render import figure_a2a, load_results, render_a2a

pytestmark = pytest.mark.slow


def test_affinity_traffic_starts_each_topic_on_its_rank():
    trace, origin = a2a.traffic_trace("affinity", 4000, seed=0)
    assert trace.shape == (4000, a2a.LAYERS, a2a.TOP_K) and set(origin.tolist()) == set(range(a2a.RANKS))
    rows = a2a.runtime_rows(trace, origin, steps=2, batch=8)
    # Rank r at step s reads rows (s * W + r) * N ...: all from tokens that start on r.
    for step in range(2):
        for rank in range(a2a.RANKS):
            block = rows[(step * a2a.RANKS + rank) * 8:(step * a2a.RANKS + rank + 1) * 8]
            starts = [int(origin[np.flatnonzero((trace == row).all(axis=(1, 2)))[0]]) for row in block]
            assert starts == [rank] * 8
    # The affinity placement keeps most of a rank's pairs on it; the contiguous map does not.
    load = a2a.origin_load(trace, origin)
    placed = a2a.affinity_placement(trace, origin)
    local = sum(load[r, layer, np.unique(placed[layer].reshape(a2a.RANKS, -1)[r])].sum()
                for r in range(a2a.RANKS) for layer in range(a2a.LAYERS))
    assert local / load.sum() > 0.6


def test_uniform_and_skewed_traffic():
    uniform, _ = a2a.traffic_trace("uniform", 8000, seed=1)
    skewed, _ = a2a.traffic_trace("skewed", 8000, seed=1)
    for trace in (uniform, skewed):
        assert np.all(np.diff(np.sort(trace, axis=2), axis=2) != 0)  # distinct experts per token
    counts = np.bincount(skewed[:, 0].ravel(), minlength=a2a.EXPERTS)
    assert counts[0] > 3 * counts[-1] and np.argmax(counts) == 0
    assert np.bincount(uniform[:, 0].ravel()).min() > 0.8 * np.bincount(uniform[:, 0].ravel()).max()


def test_a_tiny_run_for_real(tmp_path):
    started = time.monotonic()
    run = CliRunner().invoke(main, ["bench", "a2a", "--json", "--link-rate", "200", "--steps", "1",
                                    "--warmup-steps", "0", "--batch-tokens", "32", "--hidden", "64", "--ffn", "16",
                                    "--tokens", "512", "--results-dir", str(tmp_path)])
    assert run.exit_code == 0, run.output
    assert time.monotonic() - started < 240
    result = json.loads(next(line for line in run.output.splitlines() if line.startswith("{")))
    assert set(result["traffics"]) == {"uniform", "skewed", "affinity"}
    for traffic in result["traffics"].values():
        assert set(traffic["arms"]) == {"contiguous+none", "contiguous+aurora", "affinity+none", "affinity+aurora"}
        assert traffic["outputs_identical_across_schedules"]
        for arm in traffic["arms"].values():
            assert arm["pairs_lost"] == 0 and arm["bound_seconds_per_step"] > 0
    assert len(result["links"]["link_bytes_per_second"]) == 4 and set(result["goals"]) >= {"under_5_minutes"}
    records = load_results(tmp_path)
    assert records and "Goals:" in render_a2a(records) and figure_a2a(records).startswith("<svg")
