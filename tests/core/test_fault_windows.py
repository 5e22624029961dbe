"""Windows recorded from the reference runtime under injected faults (scripts/record_fault_windows.py,
tests/data/fault_windows/): every layer of every window gets the verdict and cause that the
injection makes true (labels.json). Real measurements, not hand-built numbers: a triage change that
misreads a real straggler, slow link or small batch fails here.

A CPU-starved rank (a cgroup CPU quota) is named in every layer of each window where one window
shows it slow (its pairs per second under `straggler_relative_speed` of the median rank's). Some
windows of a rank at half a core or a third of one read it only 0.87-0.89 of the median: as slow
as the healthy recording's slowest window read a rank that other work on the shared host slowed
(0.89). One window cannot tell those apart; the triage then reports `healthy` (never another
cause), and the agent's rank speed over consecutive windows (agent/rank_speed.py) names the rank
slow (docs/triage.md, "A CPU-starved rank")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moewatch import telemetry as tm
from moewatch.agent.rank_speed import RankSpeedParams, RankSpeedState, observe
from moewatch.telemetry import Window
from moewatch.thresholds import Thresholds
from moewatch.triage import diagnose

DATA = Path(__file__).resolve().parents[1] / "data" / "fault_windows"
CASES = ["healthy", "healthy-a2a", "cpu-quota", "cpu-quota-25", "cpu-quota-50", "cpu-quota-a2a", "slow-device",
         "slow-link", "hot-experts", "small-batch"]
# The rank each CPU-quota case starves (rank 1's process is in the quota group).
STARVED = {"cpu-quota": 1, "cpu-quota-25": 1, "cpu-quota-50": 1, "cpu-quota-a2a": 1}


def _labels() -> dict:
    return json.loads((DATA / "labels.json").read_text())


def _windows(case: str) -> list[Window]:
    return [Window.from_dict(d) for d in json.loads((DATA / f"{case}.json").read_text())["windows"]]


def test_every_case_is_recorded_and_labelled():
    labels = _labels()
    assert sorted(labels) == sorted(CASES)
    for case in CASES:
        assert {"verdict", "cause", "injection", "recorded"} <= set(labels[case])
        assert 6 <= len(_windows(case)) <= 10


@pytest.mark.parametrize("case", [c for c in CASES if c not in STARVED])
def test_every_layer_of_every_window_gets_the_labelled_verdict(case):
    label = _labels()[case]
    wanted = (label["verdict"], label["cause"])
    wrong = [(index, d.layer, d.verdict, d.cause)
             for index, window in enumerate(_windows(case)) for d in diagnose(window).layers
             if (d.verdict, d.cause) != wanted]
    assert not wrong, f"{case}: wanted {wanted}; (window, layer, verdict, cause) that differ: {wrong}"


@pytest.mark.parametrize("case", sorted(STARVED))
def test_a_starved_rank_is_a_straggler_in_every_layer_of_a_window_that_shows_it(case):
    """Where the window shows the starved rank slow, every layer is the label (transfer-dominated or
    not); where it does not, every layer is `healthy` and the rank still reads slower than the median."""
    label, rank, t = _labels()[case], STARVED[case], Thresholds()
    assert (label["verdict"], label["cause"]) == ("imbalance-bound", "straggler")
    wrong, unseen = [], 0
    for index, window in enumerate(_windows(case)):
        speed = float(tm.relative_rank_speed(window)[rank])
        layers = diagnose(window, t).layers
        if speed < t.straggler_relative_speed:
            wrong += [(index, d.layer, d.verdict, d.cause) for d in layers
                      if (d.verdict, d.cause) != ("imbalance-bound", "straggler")]
        else:
            unseen += 1
            assert speed < 1.0, f"{case} window {index}: the starved rank is not slower at all ({speed:.3f})"
            wrong += [(index, d.layer, d.verdict, d.cause) for d in layers if (d.verdict, d.cause) != ("healthy", None)]
    assert not wrong, f"{case}: (window, layer, verdict, cause) that differ: {wrong}"
    assert unseen <= len(_windows(case)) // 2, f"{case}: {unseen} windows do not show the starved rank"


def _rank_speed_judgement(case: str) -> tuple[int, ...]:
    """The ranks the agent's rank-speed estimator calls slow after every window of a case, in order."""
    state, params = RankSpeedState(), RankSpeedParams()
    for window in _windows(case):
        state, _ = observe(state, tm.rank_speed(window), tm.rank_load(window).sum(axis=0),
                           window.end_time - window.start_time, params)
    return state.slow_ranks


@pytest.mark.parametrize("case", CASES)
def test_the_agent_names_the_starved_rank_slow_over_consecutive_windows(case):
    """Windows one by one can miss a rank at half a core; the agent's judgement over windows does not,
    and it names no rank in the cases without a slowed one."""
    slowed = {"slow-device": 1, **STARVED}
    assert _rank_speed_judgement(case) == ((slowed[case],) if case in slowed else ())
