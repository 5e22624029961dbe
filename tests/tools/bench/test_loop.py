"""`moewatch bench loop`'s arithmetic on known windows and events (the runs themselves are in
tests/runtime/test_gpu_check.py's rehearsal and in the bench's own output)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moewatch.tools.demo import migration_spans, step_figures, steady_windows
from moewatch.tools.bench.loop import summarise_runs, windows_to_fix
from moewatch.agent.store import TriagedWindow
from moewatch.triage import diagnose

L, E, P, W = 2, 8, 12, 4


def _window(helpers, pmap, epoch, start, step_s):
    w = helpers.make_window(helpers.hot_load(L, E), pmap, W, epoch=epoch, start_time=start)
    w = dataclasses.replace(w, step_seconds=np.full(w.steps, step_s), end_time=start + step_s * w.steps)
    return TriagedWindow(w, diagnose(w), 0.0)


def _run(helpers):
    """Three windows on the contiguous map (hot expert 0 on GPU 0), one during the migration, then
    three on a map that spreads expert 0 over every GPU."""
    old = helpers.contiguous(L, E, P)
    new = old.copy()
    new[:, [3, 6, 9]] = 0  # a replica of the hot expert on each other GPU (slots 3, 6, 9 start GPUs 1-3)
    new[:, 11] = 3
    new[:, 10] = 6
    new[:, 8] = 1  # keeps 1, 2 and 7 ... every expert keeps a slot
    windows = [_window(helpers, old, 0, 1000.0 + 10 * i, 0.5) for i in range(4)]
    windows += [_window(helpers, new, 1, 1040.0 + 10 * i, 0.3) for i in range(3)]
    events = [{"event": "plan_sent", "time": 1031.0, "epoch": 1},
              {"event": "plan_applied", "time": 1041.0, "epoch": 1, "stall_seconds": 0.4}]
    return windows, events


def test_windows_to_fix_counts_from_the_first_imbalanced_window_to_the_first_balanced_one(helpers):
    windows, _ = _run(helpers)
    assert all(d.verdict == "imbalance-bound" for d in windows[0].diagnosis.layers)
    assert max(d.metrics["rank_load_max_mean"] for d in windows[4].diagnosis.layers) <= 1.15
    assert windows_to_fix(windows) == 4
    assert windows_to_fix(windows[:4]) is None  # never fixed


def test_steady_state_leaves_out_the_window_that_carried_the_migration(helpers):
    windows, events = _run(helpers)
    # The Ack arrives after the new epoch's first window began: that window is steady all the same.
    assert migration_spans(events) == [(1031.0, 1041.0, 1)]
    steady = steady_windows(windows, events)
    assert all(t is not windows[3] for t in steady) and len(steady) == 6
    f = step_figures(windows, events, warmup_steps=2)
    assert f["windows_before"] == 3 and f["windows_after"] == 3
    assert f["step_p50_before_s"] == 0.5 and f["step_p50_after_s"] == 0.3
    assert f["migration_stall_s"] == {"total": 0.4, "per_plan": [0.4]}


def test_repeat_counts_false_rollbacks_over_runs():
    run = {"false_rollbacks": 0, "pairs_lost": 0, "step_p50_ratio": 0.7, "windows_to_fix": 3}
    out = summarise_runs([run, {**run, "false_rollbacks": 1, "step_p50_ratio": 0.9}, {**run, "windows_to_fix": None}])
    assert out["repeat"] == 3 and out["false_rollbacks"] == 1 and out["runs_with_false_rollback"] == 1
    assert out["runs_fixed"] == 2 and out["step_p50_ratio_median"] == 0.7


def test_a_slow_rank_run_is_fixed_by_time_and_counted_from_the_first_plan(helpers):
    """Balanced pairs, rank 1 twice as slow: three windows on the even map (time balancedness 0.75),
    the plan sent during the third, then the speed-aware map (5.5 / 2.5 units: times nearly equal)."""
    from moewatch.tools.bench.loop import time_fixed, windows_from_plan_to_fix
    from moewatch.tools.demo import mean_time_balancedness

    even = helpers.contiguous(2, E, P)
    uneven = even.copy()
    uneven[:, 6:] = [6, 7, 0, 6, 7, 6]  # rank 1: experts 6, 7 alone (padded) and 0 shared with rank 0
    uneven[:, :6] = [0, 1, 2, 3, 4, 5]

    def window(pmap, epoch, start):
        w = helpers.make_window(np.full((2, E), 100), pmap, 2, epoch=epoch, start_time=start, rank_slowdown=(1.0, 2.0))
        w = dataclasses.replace(w, end_time=start + 5.0)
        return TriagedWindow(w, diagnose(w), 0.0)

    windows = [window(even, 0, 1000.0 + 10 * i) for i in range(3)] + \
        [window(uneven, 1, 1040.0 + 10 * i) for i in range(2)]
    events = [{"event": "plan_sent", "time": 1022.0, "epoch": 1},
              {"event": "plan_applied", "time": 1030.0, "epoch": 1, "stall_seconds": 0.1}]
    assert not any(time_fixed(t) for t in windows[:3]) and all(time_fixed(t) for t in windows[3:])
    assert windows_to_fix(windows, time_fixed) == 3
    assert windows_from_plan_to_fix(windows, events, time_fixed) == 1
    assert windows_from_plan_to_fix(windows[:3], events, time_fixed) is None
    assert mean_time_balancedness(windows[:3]) == pytest.approx(0.75)
    assert mean_time_balancedness(windows[3:]) > 0.9
    f = step_figures(windows, events)
    assert f["time_balancedness_before"] == pytest.approx(0.75) and f["time_balancedness_after"] > 0.9
