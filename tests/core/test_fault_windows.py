"""Windows recorded from the reference runtime under injected faults (scripts/record_fault_windows.py,
tests/data/fault_windows/): every layer of every window gets the verdict and cause that the
injection makes true (labels.json). Real measurements, not hand-built numbers: a triage change that
misreads a real straggler, slow link or small batch fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moewatch.telemetry import Window
from moewatch.triage import diagnose

DATA = Path(__file__).resolve().parents[1] / "data" / "fault_windows"
CASES = ["healthy", "cpu-quota", "slow-device", "slow-link", "hot-experts", "small-batch"]


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


@pytest.mark.parametrize("case", CASES)
def test_every_layer_of_every_window_gets_the_labelled_verdict(case):
    label = _labels()[case]
    wanted = (label["verdict"], label["cause"])
    wrong = [(index, d.layer, d.verdict, d.cause)
             for index, window in enumerate(_windows(case)) for d in diagnose(window).layers
             if (d.verdict, d.cause) != wanted]
    assert not wrong, f"{case}: wanted {wanted}; (window, layer, verdict, cause) that differ: {wrong}"
