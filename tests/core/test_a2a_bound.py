"""The all-to-all bound in the window (a2a_bound_seconds, a2a_over_bound: an additive v1 extension)
and the triage's `schedule` action on a comm-bound / volume layer far above it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moewatch import telemetry as tm
from moewatch.schema import packaged_schema, window_schema
from moewatch.telemetry import Window, WindowError
from moewatch.thresholds import Thresholds
from moewatch.triage import diagnose

W = 4


def _volume(hand, **overrides):
    # share = 4 / 6 = 0.67; balanced; cross 0.75 as predicted: comm-bound / volume (test_triage.py).
    return hand.window(hand.uniform(W, 1000), [0.5] * W, [0.5] * W, [0.5] * W, **overrides)


def test_far_above_the_bound_gets_schedule_with_its_gain(hand):
    bound = 0.25  # the slowest rank's dispatch + combine is 1.0 s: 4x the bound
    w = _volume(hand, a2a_bound_seconds=[bound], a2a_over_bound=[4.0])
    d = diagnose(w).layers[0]
    assert (d.verdict, d.cause) == ("comm-bound", "volume")
    assert d.metrics["a2a_over_bound"] == pytest.approx(4.0)
    assert d.metrics["a2a_bound_seconds_per_step"] == pytest.approx(0.25)
    schedule = [a for a in d.actions if a.kind == "schedule"]
    assert len(schedule) == 1
    share = d.metrics["a2a_transfer_share"]
    assert schedule[0].predicted_gain == pytest.approx(share * (1 - 1 / 4.0))
    assert schedule[0].params == {"schedule": "aurora", "over_bound": 4.0}


def test_near_the_bound_or_without_it_no_schedule(hand):
    near = _volume(hand, a2a_bound_seconds=[0.9], a2a_over_bound=[1.0 / 0.9])
    assert all(a.kind != "schedule" for a in diagnose(near).layers[0].actions)
    # A threshold can still move the line: at 1.05 the same layer is far enough above its bound.
    assert any(a.kind == "schedule" for a in diagnose(near, Thresholds(schedule_over_bound=1.05)).layers[0].actions)
    unknown = _volume(hand)  # no link rate known: the bound is absent, never guessed
    d = diagnose(unknown).layers[0]
    assert d.metrics["a2a_over_bound"] is None and d.metrics["a2a_bound_seconds_per_step"] is None
    assert all(a.kind != "schedule" for a in d.actions)


def test_not_offered_off_volume(hand):
    # Imbalanced (a hot rank) far above the bound: ordering is not what the layer needs first.
    traffic = hand.uniform(W, 1000)
    traffic[:, 0] *= 4
    w = hand.window(traffic, [0.5] * W, [0.5] * W, [0.5] * W, a2a_bound_seconds=[0.1], a2a_over_bound=[10.0])
    d = diagnose(w).layers[0]
    assert d.cause != "volume"
    assert all(a.kind != "schedule" for a in d.actions)


def test_fields_come_together_and_agree_with_the_phase_times(hand):
    with pytest.raises(WindowError) as err:
        _volume(hand, a2a_bound_seconds=[0.25])
    assert err.value.field == "a2a_over_bound"
    with pytest.raises(WindowError) as err:
        _volume(hand, a2a_over_bound=[4.0])
    assert err.value.field == "a2a_bound_seconds"
    with pytest.raises(WindowError) as err:
        _volume(hand, a2a_bound_seconds=[0.25], a2a_over_bound=[3.0])
    assert err.value.field == "a2a_over_bound[0]"
    with pytest.raises(WindowError) as err:
        _volume(hand, a2a_bound_seconds=[-0.25], a2a_over_bound=[0.0])
    assert err.value.field == "a2a_bound_seconds"
    zero = _volume(hand, a2a_bound_seconds=[0.0], a2a_over_bound=[0.0])  # nothing crossed a link
    assert zero.a2a_over_bound[0] == 0.0


def test_round_trips_and_schema(hand):
    w = _volume(hand, a2a_bound_seconds=[0.25], a2a_over_bound=[4.0])
    for back in (Window.from_json(w.to_json()), Window.from_bytes(w.to_bytes())):
        np.testing.assert_array_equal(back.a2a_bound_seconds, [0.25])
        np.testing.assert_array_equal(back.a2a_over_bound, [4.0])
    assert packaged_schema() == window_schema()
    props = packaged_schema()["properties"]
    assert {"a2a_bound_seconds", "a2a_over_bound"} <= set(props)
    assert "a2a_bound_seconds" not in packaged_schema()["required"]
    # An older reader's view: unknown keys are kept, so a window without them reads as before.
    data = json.loads(w.to_json())
    data.pop("a2a_bound_seconds"), data.pop("a2a_over_bound")
    assert Window.from_dict(data).a2a_bound_seconds is None


def test_over_bound_is_the_slowest_rank_over_the_bound():
    np.testing.assert_allclose(tm.a2a_over_bound(np.array([[0.2, 0.5], [0.1, 0.1]]), np.array([0.25, 0.0])),
                               [2.0, 0.0])
