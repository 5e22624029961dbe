"""A starved rank's stall inside the all-to-all, against a slow link: which reading a transfer-dominated
layer gets when the window has a slow rank (docs/triage.md, "A CPU-starved rank").

Built from recorded windows (tests/data/fault_windows/): a CPU-quota window with one layer's dispatch
lengthened on both ranks, as a stall of the starved rank inside the collective does (it is held
mid-transfer and its peer waits for its rows; the reference runtime's gloo transfer is the ranks' own
CPU work), and the slow-link recording with one rank's expert compute slowed, as a slow device
beside a slow link does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moewatch import telemetry as tm
from moewatch.triage import diagnose

DATA = Path(__file__).resolve().parents[1] / "data" / "fault_windows"


def _windows(case: str) -> list[tm.Window]:
    return [tm.Window.from_dict(d) for d in json.loads((DATA / f"{case}.json").read_text())["windows"]]


def _stalled(w: tm.Window, layer: int, share: float) -> tm.Window:
    """w with a stall added to `layer`'s dispatch on every rank, long enough that the layer's transfer
    share becomes `share` (transfer and layer time both grow by it on each rank)."""
    W = w.world_size
    transfer = float(tm.a2a_transfer_seconds(w)[layer])
    total = float(w.layer_seconds[layer].sum())
    stall = (share * total - W * transfer) / (W * (1.0 - share))
    dispatch, layer_seconds = np.array(w.dispatch_seconds), np.array(w.layer_seconds)
    dispatch[layer] += stall
    layer_seconds[layer] += stall
    return w.replace(dispatch_seconds=dispatch, layer_seconds=layer_seconds)


@pytest.mark.parametrize("case", ["cpu-quota", "cpu-quota-25", "cpu-quota-a2a"])
def test_a_stall_inside_the_all_to_all_of_a_starved_rank_is_read_as_the_straggler(case):
    """Fails on the old order, which called the layer `comm-bound / volume`."""
    w = next(w for w in _windows(case) if tm.relative_rank_speed(w)[1] < 0.85)
    stalled = _stalled(w, 2, 0.6)
    assert tm.a2a_transfer_share(stalled)[2] == pytest.approx(0.6)
    assert np.median(tm.a2a_transfer_share(stalled)) < 0.5
    d = diagnose(stalled).layers[2]
    assert (d.verdict, d.cause) == ("imbalance-bound", "straggler")
    assert d.metrics["other_reading"] == {"verdict": "comm-bound", "cause": "volume"}
    assert any("Rank 1 is slow" in line and "comm-bound / volume" in line for line in d.evidence)
    assert d.actions and d.actions[0].kind == "placement"
    # The other layers keep their reading, with no other one.
    assert all((x.verdict, x.cause, x.metrics["other_reading"]) == ("imbalance-bound", "straggler", None)
               for x in diagnose(stalled).layers if x.layer != 2)


def test_a_slow_link_stays_comm_bound_beside_a_slow_device():
    """Every layer's transfer dominates: the link is read first, the slow device second."""
    w = _windows("slow-link")[0]
    assert tm.relative_rank_speed(w)[1] > 0.85
    compute = np.array(w.compute_seconds)
    added = compute[:, 1] * 1.5  # rank 1 computes at 0.4 of its speed; rank 0 waits for it in the combine
    compute[:, 1] += added
    combine = np.array(w.combine_seconds)
    combine[:, 0] += added
    slowed = w.replace(compute_seconds=compute, combine_seconds=combine, layer_seconds=w.layer_seconds + added[:, None])
    assert tm.relative_rank_speed(slowed)[1] < 0.85
    layers = diagnose(slowed).layers
    assert {(d.verdict, d.cause) for d in layers} == {("comm-bound", "volume")}
    for d in layers:
        assert d.metrics["other_reading"] == {"verdict": "imbalance-bound", "cause": "straggler"}
        assert any("Rank 1 is also slow" in line for line in d.evidence)


def test_a_slow_link_alone_has_no_other_reading():
    for w in _windows("slow-link"):
        assert all(d.metrics["other_reading"] is None for d in diagnose(w).layers)
