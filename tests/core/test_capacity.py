"""The capacity factor's one home: the window solve, the per-step solve, and the policy's feed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from moewatch.capacity import (capacity_for_target, capacity_for_windows, expert_capacity, round_up_capacity,
                               step_overflow_rate, mean_load_capacities, mean_load_overflow_rates)


def test_the_window_solve_is_the_per_step_solve_of_one_step():
    rng = np.random.default_rng(3)
    load = rng.integers(0, 500, size=(6, 16)).astype(np.float64)
    exact = mean_load_capacities(load, 0.02)
    replayed = capacity_for_target(load[None], target=0.02).capacity_factor
    assert replayed == pytest.approx(round_up_capacity(exact, 1e-3))
    assert mean_load_overflow_rates(load, exact) == pytest.approx(step_overflow_rate(load[None], exact))


def test_dropless_overflows_nothing():
    load = np.array([[[9.0, 1.0, 1.0, 1.0]]])
    assert step_overflow_rate(load, np.array([0.0])).tolist() == [0.0]
    assert expert_capacity(0.0, 100, 2, 8) is None


def test_spread_between_windows_raises_c_over_the_average():
    # The hot expert moves from window to window: their sum looks even, their steps do not.
    loads = [np.roll([400, 50, 50, 50, 50, 50, 50, 50], i) for i in range(4)]
    # The solve reads only each window's routed pairs and steps.
    windows = [SimpleNamespace(expert_tokens=np.array([row]), steps=10) for row in loads]
    windows.append(SimpleNamespace(expert_tokens=None, steps=10))  # per-rank totals only: left out
    rows = np.array(loads, dtype=np.float64)
    average = mean_load_capacities(rows.sum(axis=0)[None], 0.01)[0]
    per_step = capacity_for_windows(windows, 0, 0.01)
    assert per_step > 2 * average
    assert step_overflow_rate(rows[:, None, :], np.array([per_step]))[0] <= 0.01
    assert step_overflow_rate(rows[:, None, :], np.array([per_step - 0.01]))[0] > 0.01
    assert capacity_for_windows(windows[-1:], 0, 0.01) == 0.0


def test_round_up_keeps_the_target():
    assert round_up_capacity(1.231) == pytest.approx(1.24)
    assert round_up_capacity(1.23) == pytest.approx(1.23)
    assert round_up_capacity(np.array([1.2301, 2.0]), 1e-3).tolist() == pytest.approx([1.231, 2.0])
