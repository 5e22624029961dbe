"""The stepping thread of `bench eplb` (tools/bench/stepping.py): a policy that holds the GIL delays its
steps, one that sleeps or computes with the GIL released does not."""

from __future__ import annotations

import time

import numpy as np
import pytest

from moewatch.tools.bench.eplb import stepping_pauses
from moewatch.tools.bench.stepping import SteppingThread, pause_figures


def _python_loop(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def _c_loop_holding_the_gil(seconds: float) -> None:
    """sum() over a range runs in C without letting another thread take the GIL."""
    n = 1_000_000
    while True:
        started = time.perf_counter()
        sum(range(n))
        if time.perf_counter() - started >= seconds:
            return
        n *= 2


def test_a_python_loop_delays_every_step_and_a_sleep_does_not():
    with SteppingThread() as busy:
        _python_loop(0.3)
    with SteppingThread() as idle:
        time.sleep(0.3)
    busy_f, idle_f = pause_figures(busy.gaps), pause_figures(idle.gaps)
    # the loop lets the stepper in once per switch interval (5 ms): its typical step waits that long
    assert busy_f["pause_median_seconds"] >= 0.004 and busy_f["pause_max_seconds"] >= 0.004
    assert idle_f["pause_median_seconds"] < 0.003
    assert idle_f["steps"] > 2 * busy_f["steps"]


def test_c_code_holding_the_gil_shows_one_long_pause_and_c_code_releasing_it_none():
    with SteppingThread() as held:
        _c_loop_holding_the_gil(0.25)
    released = stepping_pauses(lambda t: np.linalg.eigvalsh(np.eye(2)) if t else time.sleep(0.25), 2)
    assert pause_figures(held.gaps)["pause_max_seconds"] >= 0.2
    assert released["pause_max_seconds"] < 0.1 and released["steps"] > 50
    assert set(released) == {"pause_max_seconds", "pause_p99_seconds", "pause_median_seconds", "steps",
                             "step_interval_seconds"}


def test_no_steps_no_figures_and_a_bad_interval_is_refused():
    assert pause_figures([])["pause_max_seconds"] is None
    with pytest.raises(ValueError, match="interval"):
        SteppingThread(0)
