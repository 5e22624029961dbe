"""Metric families are declared once, by the concern that writes them, and checked when declared."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from moewatch.agent.catalog import BY_NAME, CONCERNS, METRICS
from moewatch.agent.metrics.actions import ACTIONS_TOTAL
from moewatch.agent.metrics.family import Counter, FamilyError, Gauge, Histogram
from moewatch.agent.metrics.state import MetricsState
from moewatch.agent.metrics.windows import LAYER_A2A_SHARE, LAYER_A2A_STEP


@pytest.mark.parametrize("declare, problem", [
    (lambda: Counter("moewatch_actions", ("kind",), "x"), "_total"),
    (lambda: Gauge("moewatch_open_total", (), "x"), "_total"),
    (lambda: Gauge("agent_seconds", (), "x", unit="seconds"), "moewatch_"),
    (lambda: Gauge("moewatch_Layer_time", (), "x"), "snake case"),
    (lambda: Gauge("moewatch_step_ms", (), "x"), "base units"),
    (lambda: Gauge("moewatch_step_seconds", (), "x"), "unit='seconds'"),
    (lambda: Gauge("moewatch_step_time", (), "x", unit="seconds"), "_seconds"),
    (lambda: Gauge("moewatch_step_minutes", (), "x", unit="minutes"), "not a base unit"),
    (lambda: Gauge("moewatch_depth", ("layer", "layer"), "x"), "repeat"),
    (lambda: Gauge("moewatch_depth", ("le",), "x"), "reserved"),
    (lambda: Gauge("moewatch_depth", (), " "), "help"),
    (lambda: Histogram("moewatch_wait_seconds", (), "x", unit="seconds", buckets=(0.2, 0.1)), "ascending"),
])
def test_a_declaration_that_breaks_a_convention_raises(declare, problem):
    with pytest.raises(FamilyError, match=problem):
        declare()


def test_the_catalogue_lists_every_declared_family_once():
    declared = [f for concern in CONCERNS for f in concern.FAMILIES]
    assert sorted(f.name for f in declared) == sorted(m.name for m in METRICS)
    assert len(BY_NAME) == len(METRICS)


def test_a_family_writes_only_its_own_kind_and_label_width():
    state = MetricsState()
    state[ACTIONS_TOTAL].inc(("m", "g", "replicate", "applied"), 2)
    assert state.get("moewatch_actions_total", ("m", "g", "replicate", "applied")) == 2
    assert state[ACTIONS_TOTAL] is state["moewatch_actions_total"]
    with pytest.raises(TypeError, match="counter"):
        state[ACTIONS_TOTAL].set(("m", "g", "replicate", "applied"), 1)
    with pytest.raises(ValueError, match="decrease"):
        state[ACTIONS_TOTAL].inc(("m", "g", "replicate", "applied"), -1)
    with pytest.raises(ValueError, match="expected labels"):
        state[LAYER_A2A_SHARE].set(("m", "g"), 0.5)
    with pytest.raises(TypeError, match="histogram"):
        state[LAYER_A2A_STEP].set(("m", "g", "0"), 0.5)
    with pytest.raises(KeyError, match="not in the metric catalogue"):
        state["moewatch_actoins_total"]


def test_a_misspelt_family_fails_at_import():
    code = "from moewatch.agent.metrics.actions import ACTOINS_TOTAL"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0 and "ImportError" in done.stderr


def test_storage_imports_no_presentation():
    """The store and the metric state load without the exporters or prometheus_client."""
    code = ("import sys, moewatch.agent.store, moewatch.agent.metrics.state, moewatch.agent.catalog; "
            "print(sorted(m for m in sys.modules if m.startswith(('prometheus_client', 'moewatch.agent.exporters'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_batched_writes_store_what_one_at_a_time_writes():
    """The batched forms the window's export uses are equal to the one-series forms they replace."""
    from moewatch.agent.metrics.windows import (LAYER_EXPERT_LOAD_SHARE, LAYER_ROUTED_PAIRS_TOTAL, LAYER_VERDICT,
                                                RANK_LOAD_PAIRS)

    rng = np.random.default_rng(3)
    rows = rng.lognormal(0.0, 1.0, (6, 40))
    rows[2, 5], rows[4, :] = np.nan, np.inf  # non-finite values are not observed, as in observe()
    keys = [("m", "g", str(layer)) for layer in range(6)]
    one, batch = MetricsState(), MetricsState()
    for key, row in zip(keys, rows):
        one[LAYER_EXPERT_LOAD_SHARE].observe(key, row)
    batch[LAYER_EXPERT_LOAD_SHARE].observe_rows(keys, rows)
    assert one.histogram_series(LAYER_EXPERT_LOAD_SHARE) == batch.histogram_series(LAYER_EXPERT_LOAD_SHARE)
    for _ in range(2):
        values = rng.integers(0, 1000, 6).tolist()
        for key, value in zip(keys, values):
            one[LAYER_ROUTED_PAIRS_TOTAL].inc(key, value)
            one[LAYER_VERDICT].set((*key, "healthy", "none"), value % 2)
        batch[LAYER_ROUTED_PAIRS_TOTAL].inc_many(zip(keys, values), chunk=("m", "g"))
        batch[LAYER_VERDICT].set_many([((*key, "healthy", "none"), value % 2) for key, value in zip(keys, values)],
                                      chunk=("m", "g"))
    for family in (LAYER_ROUTED_PAIRS_TOTAL, LAYER_VERDICT):
        assert one.series(family) == batch.series(family)
    with pytest.raises(ValueError, match="outside chunk"):
        batch[LAYER_VERDICT].set_many([(("m", "other", "0", "healthy", "none"), 1.0)], chunk=("m", "g"))
    with pytest.raises(ValueError, match="bad increment"):
        batch[LAYER_ROUTED_PAIRS_TOTAL].inc_many([(keys[0], -1.0)], chunk=("m", "g"))
    rank_keys = [(*key, str(rank)) for key in keys for rank in range(4)]
    for _ in range(2):
        values = rng.lognormal(0.0, 3.0, len(rank_keys)).tolist()
        for key, value in zip(rank_keys, values):
            one[RANK_LOAD_PAIRS].set(key, value)
        batch[RANK_LOAD_PAIRS].set_columns(rank_keys, values, chunk=("m", "g"))
        assert one.series(RANK_LOAD_PAIRS) == batch.series(RANK_LOAD_PAIRS)
    with pytest.raises(ValueError, match="outside chunk"):
        batch[RANK_LOAD_PAIRS].set_columns([("m", "other", "0", "0")], [1.0], chunk=("m", "g"))
    with pytest.raises(ValueError, match="2 label tuples for 1 values"):
        batch[RANK_LOAD_PAIRS].set_columns(rank_keys[:2], [1.0], chunk=("m", "g"))


def test_the_exposition_formats_numbers_as_prometheus_client_does():
    from prometheus_client.utils import floatToGoString

    from moewatch.agent.exporters import go_floats

    rng = np.random.default_rng(0)
    values = [0.0, -0.0, 1.0, 1e6, 999999.5, 1234567.0, 12345678.9, 1e21, 1e-7, -1234567.0, float("inf"),
              float("-inf"), float("nan"), 2.0 ** 60, *rng.lognormal(0, 8, 2000).tolist(),
              *(-rng.lognormal(0, 8, 200)).tolist(), *rng.integers(0, 10 ** 9, 500).astype(float).tolist()]
    assert go_floats(values) == [floatToGoString(v) for v in values]
