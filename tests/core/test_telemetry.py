"""The Window: invariants rejected with the field named, lossless JSON and binary forms, schema."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moewatch import telemetry as tm
from moewatch.tools.examples import SCENARIOS, scenario, simulate
from moewatch.schema import packaged_schema, window_schema
from moewatch.telemetry import Window, WindowError


@pytest.fixture(scope="module")
def window() -> Window:
    return simulate(scenario("imbalance-hot-experts", extra_slots=4, capacity_factor=1.5), seed=11)


def assert_same(a: Window, b: Window) -> None:
    for name in tm.SCALAR_FIELDS:
        assert getattr(a, name) == getattr(b, name), name
    for name in tm.ARRAY_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if x is None:
            assert y is None, name
        else:
            assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert dict(a.extra) == dict(b.extra)


def test_json_round_trip_is_lossless(window):
    again = Window.from_json(window.to_json())
    assert_same(window, again)
    assert again.to_json() == window.to_json()


def test_binary_round_trip_is_lossless_and_smaller(window):
    blob = window.to_bytes()
    assert blob[:4] == b"MWW1"
    assert_same(window, Window.from_bytes(blob))
    assert len(blob) < len(window.to_json())


def test_traffic_is_optional_in_both_forms(window):
    bare = window.replace(traffic=None)
    assert_same(bare, Window.from_json(bare.to_json()))
    assert_same(bare, Window.from_bytes(bare.to_bytes()))


def test_unknown_fields_survive_a_round_trip(window):
    data = window.to_dict()
    data["gpu_clock_mhz"] = [1980, 1975]
    again = Window.from_dict(data)
    assert again.extra["gpu_clock_mhz"] == [1980, 1975]
    assert Window.from_bytes(again.to_bytes()).extra["gpu_clock_mhz"] == [1980, 1975]


def test_window_arrays_are_read_only(window):
    with pytest.raises(ValueError):
        window.expert_tokens[0, 0] = 1


def break_field(window: Window, name: str, mutate) -> dict:
    data = window.to_dict()
    data[name] = mutate(data[name])
    return data


def _set(path, value):
    def mutate(x):
        x = json.loads(json.dumps(x))
        target = x
        for i in path[:-1]:
            target = target[i]
        target[path[-1]] = value
        return x
    return mutate


@pytest.mark.parametrize("name,mutate,needle", [
    ("schema", lambda x: "moewatch.window/v9", "unknown schema"),
    ("expert_tokens", lambda x: x[:-1], "shape"),
    ("slot_tokens", _set((0, 0), -1), "negative"),
    ("dispatch_seconds", _set((0, 0), float("nan")), "NaN"),
    ("physical_to_logical_map", _set((0, 0), 99), "outside"),
    ("physical_to_logical_map", lambda x: [[0] * len(row) for row in x], "has no slot"),
    ("sent_tokens", _set((0, 0), 10**9), "sum(local_tokens) + sum(sent_tokens)"),
    ("traffic", _set((0, 0, 1), 10**9), "traffic"),
    ("step_tokens", lambda x: x[:-1], "shape"),
    ("world_size", lambda x: "four", "integer"),
    ("steps", lambda x: None, "integer"),
    ("end_time", lambda x: -5.0, "end_time"),
    ("expert_tokens", lambda x: [[1.5] * len(row) for row in x], "integers"),
    ("local_tokens", lambda x: [[1, 2], [3]], "ragged"),
])
def test_each_broken_invariant_is_rejected_with_its_field(window, name, mutate, needle):
    data = break_field(window, name, mutate)
    with pytest.raises(WindowError) as err:
        Window.from_dict(data)
    assert needle.lower() in str(err.value).lower()
    assert err.value.field in (name, "<json>", "slot_tokens", "sent_tokens", "received_tokens", "traffic",
                               "physical_to_logical_map")


@pytest.mark.parametrize("name", ["expert_tokens", "physical_to_logical_map", "capacity_factor"])
def test_missing_required_field_is_named(window, name):
    # combine_seconds and the other measured fields may be absent (tests/core/test_absent_evidence.py);
    # the placement, the routed counts and the capacity factor may not.
    for change in (lambda d: d.pop(name), lambda d: d.__setitem__(name, None)):
        data = window.to_dict()
        change(data)
        with pytest.raises(WindowError, match=f"{name}: missing"):
            Window.from_dict(data)


def test_per_rank_slot_sums_must_match_local_plus_received(window):
    # Move pairs between two ranks' slots: totals still agree, per-rank sums do not.
    data = window.to_dict()
    spr = window.slots_per_rank
    data["slot_tokens"][0][0] += 5
    data["slot_tokens"][0][spr] -= 5
    with pytest.raises(WindowError, match="a rank's slots"):
        Window.from_dict(data)


PHASES = ("dispatch_seconds", "combine_seconds", "compute_seconds")


@pytest.mark.parametrize("name", PHASES)
def test_a_phase_longer_than_its_layer_is_rejected_naming_layer_and_rank(window, name):
    # Layer 3 on rank 1 takes 2 ms; its phase is said to take 5 ms: the all-to-all share would pass 1.
    data = window.to_dict()
    data["layer_seconds"][3][1] = 0.002
    for phase in PHASES:
        data[phase][3][1] = 0.0005
    data[name][3][1] = 0.005
    with pytest.raises(WindowError) as err:
        Window.from_dict(data)
    assert err.value.field == f"{name}[3][1]"
    assert "layer_seconds" in str(err.value)


def test_a_phase_within_timer_granularity_of_its_layer_is_accepted(window):
    # Clocks read on different streams: a phase 0.05 % longer than its layer is granularity, not a lie.
    data = window.to_dict()
    data["layer_seconds"][3][1] = 0.002
    for name in PHASES:
        data[name][3][1] = 0.002 * (1 + 5e-4)
    assert Window.from_dict(data).dispatch_seconds[3, 1] == pytest.approx(0.002 * (1 + 5e-4))


def test_nan_literals_in_json_are_rejected(window):
    text = window.to_json().replace('"start_time": 1', '"start_time": NaN, "x": 1', 1)
    with pytest.raises(WindowError):
        Window.from_json(text)


@pytest.mark.parametrize("cut", [1, 7, 100, 1000])
def test_truncated_binary_is_rejected(window, cut):
    blob = window.to_bytes()
    with pytest.raises(WindowError):
        Window.from_bytes(blob[:-cut])


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=400))
def test_binary_decoder_only_ever_raises_window_error(data):
    for blob in (data, b"MWW1" + data):
        try:
            Window.from_bytes(blob)
        except WindowError:
            pass


def test_schema_file_is_the_generated_one_and_accepts_examples():
    assert packaged_schema() == window_schema()
    for name in SCENARIOS:
        jsonschema.validate(simulate(SCENARIOS[name], seed=1).to_dict(), packaged_schema())


def test_derived_quantities_on_a_hand_checked_window(hand):
    traffic = [[100, 50], [10, 40]]  # rank 0 -> rank 1: 50 pairs; rank 1 -> rank 0: 10
    w = hand.window(traffic, [0.2, 0.4], [0.2, 0.4], [1.0, 0.6], dropped=[5, 5], rerouted=[0, 3],
                    hidden_bytes=1000, steps=2, top_k=2, capacity_factor=1.25, step_tokens=[50, 55])
    np.testing.assert_array_equal(tm.rank_load(w), [[110, 90]])
    assert tm.balancedness(w)[0] == pytest.approx(100 / 110)
    assert tm.rank_load_max_min(w)[0] == pytest.approx(110 / 90)
    assert tm.cross_rank_ratio(w)[0] == pytest.approx(60 / 200)
    assert tm.expected_cross_rank_ratio(w)[0] == pytest.approx(0.5)
    assert tm.overflow_rate(w)[0] == pytest.approx(13 / 210)
    assert tm.a2a_share(w)[0] == pytest.approx(1.2 / 2.8)
    # Aurora: busiest direction is rank 0's 50 sent pairs x 1000 B, once per direction.
    assert tm.a2a_lower_bound_seconds(w, 1e5)[0] == pytest.approx(2 * 50 * 1000 / 1e5)
    assert tm.a2a_efficiency(w, 1e5)[0] == 1.0  # bound 1.0 s over measured 0.8 s: capped at the bound
    assert tm.a2a_efficiency(w, 1e6)[0] == pytest.approx(0.1 / 0.8)
    assert tm.effective_capacity_factor(w)[0] == pytest.approx(200 / (1.25 * 2 * 105))
    assert tm.mean_message_bytes(w)[0] == pytest.approx(60 * 1000 / (2 * 2 * 1))
    assert tm.hot_experts(w, 1.05) == [[0]]


def test_max_min_is_infinite_when_a_rank_is_idle(hand):
    w = hand.window([[10, 0], [10, 0]], [0.1, 0.1], [0.1, 0.1], [0.1, 0.1])
    assert tm.rank_load_max_min(w)[0] == float("inf")


def test_binary_is_compact_at_production_size():
    # 58 layers x 256 experts, 288 slots on 32 ranks: the shape [measured-eplb-torch] (docs/sources.md) timed DeepSeek's EPLB on.
    w = simulate(scenario("healthy", num_layers=58, num_experts=256, extra_slots=32, world_size=32,
                          tokens_per_step=512, steps=2), seed=5)
    blob = w.to_bytes()
    assert_same(w, Window.from_bytes(blob))
    assert len(blob) < 0.6 * len(w.to_json())
