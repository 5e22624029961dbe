"""The probe on its own (one rank, no process group): the embedding API other runtimes use."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moewatch.runtime.probe import Mark, Probe, ProbeConfig
from moewatch.telemetry import Window

L, E, P = 2, 4, 6


def _probe(**changes):
    cfg = ProbeConfig(num_layers=L, num_experts=E, num_slots=P, top_k=2, hidden_bytes=256, model="m",
                      ep_group="g", **{"window_steps": 3, **changes})
    windows: list[Window] = []
    probe = Probe(cfg, sinks=[windows.append])
    probe.set_placement(0, np.tile([0, 1, 2, 3, 0, 1], (L, 1)), [0.0, 1.5])
    return probe, windows


def _step(probe, tokens, routed, slots, dropped=None, rerouted=None):
    probe.begin_step(tokens)
    for layer in range(L):
        for mark in Mark:
            probe.mark(layer, mark)
        probe.record_layer(layer, torch.tensor(routed), torch.tensor(slots),
                           None if dropped is None else torch.tensor(dropped),
                           None if rerouted is None else torch.tensor(rerouted))
    return probe.end_step()


def test_counts_accumulate_into_one_window_per_three_steps():
    probe, windows = _probe()
    for _ in range(2):
        assert _step(probe, 5, [4, 3, 2, 1], [2, 3, 2, 1, 2, 0]) is None
    window = _step(probe, 5, [4, 3, 2, 1], [2, 3, 2, 1, 2, 0])
    assert windows == [window]
    assert window.steps == 3 and window.world_size == 1 and window.epoch == 0
    np.testing.assert_array_equal(window.expert_tokens, [[12, 9, 6, 3]] * L)
    np.testing.assert_array_equal(window.slot_tokens, [[6, 9, 6, 3, 6, 0]] * L)
    np.testing.assert_array_equal(window.local_tokens, [[30]] * L)
    np.testing.assert_array_equal(window.sent_tokens, [[0]] * L)
    np.testing.assert_array_equal(window.step_tokens, [5, 5, 5])
    np.testing.assert_array_equal(window.capacity_factor, [0.0, 1.5])
    assert probe.steps_pending == 0


def test_dropped_and_rerouted_are_carried():
    probe, windows = _probe(window_steps=1)
    window = _step(probe, 5, [4, 3, 2, 1], [2, 2, 1, 1, 2, 0], dropped=[1, 0, 1, 0], rerouted=[1, 0, 0, 0])
    np.testing.assert_array_equal(window.dropped_tokens, [[1, 0, 1, 0]] * L)
    np.testing.assert_array_equal(window.rerouted_tokens, [[1, 0, 0, 0]] * L)


def test_a_new_placement_flushes_the_old_epochs_window():
    probe, windows = _probe()
    _step(probe, 5, [4, 3, 2, 1], [2, 3, 2, 1, 2, 0])
    new_map = np.tile([3, 2, 1, 0, 3, 3], (L, 1))
    probe.set_placement(7, new_map, [0.0, 0.0])
    assert len(windows) == 1 and windows[0].epoch == 0 and windows[0].steps == 1
    _step(probe, 5, [4, 3, 2, 1], [2, 3, 2, 1, 2, 0])
    probe.flush()
    assert windows[1].epoch == 7
    np.testing.assert_array_equal(windows[1].physical_to_logical_map, new_map)


def test_counts_that_break_the_window_contract_are_reported_not_raised():
    probe, windows = _probe(window_steps=1)
    # 10 pairs routed but 12 computed: an embedding bug; the step goes on, the window is refused.
    assert _step(probe, 5, [4, 3, 2, 1], [2, 3, 2, 1, 4, 0]) is None
    assert windows == [] and probe.windows_invalid == 1 and "slot_tokens" in probe.last_error


def test_timings_follow_the_marks():
    probe, windows = _probe(window_steps=1)
    probe.begin_step(1)
    probe.mark(0, Mark.LAYER_START)
    probe.mark(0, Mark.DISPATCH_START)
    probe.mark(0, Mark.DISPATCH_END)
    probe.mark(0, Mark.COMPUTE_END)
    probe.mark(0, Mark.LAYER_END)  # no COMBINE_END: combine runs to the layer's end
    probe.record_layer(0, torch.tensor([1, 1, 0, 0]), torch.tensor([1, 1, 0, 0, 0, 0]))
    probe.record_layer(1, torch.tensor([1, 1, 0, 0]), torch.tensor([1, 1, 0, 0, 0, 0]))
    window = probe.end_step()
    assert window.layer_seconds[0, 0] > 0 and window.combine_seconds[0, 0] > 0
    assert window.layer_seconds[1, 0] == 0  # layer 1 was never marked
    assert window.dispatch_seconds[0, 0] + window.compute_seconds[0, 0] + window.combine_seconds[0, 0] \
        <= window.layer_seconds[0, 0]


def test_window_seconds_sets_the_next_windows_length_from_the_pace(monkeypatch):
    probe, windows = _probe(window_steps=None, window_seconds=0.5, first_window_steps=2)
    now = [100.0]
    monkeypatch.setattr("moewatch.runtime.probe.time.perf_counter", lambda: now[0])

    def timed_step(seconds):
        probe.begin_step(1)
        now[0] += seconds
        for layer in range(L):
            probe.record_layer(layer, torch.tensor([1, 1, 0, 0]), torch.tensor([1, 1, 0, 0, 0, 0]))
        probe.end_step()

    for _ in range(2):  # before any pace is known: first_window_steps
        timed_step(0.1)
    assert [w.steps for w in windows] == [2]
    np.testing.assert_allclose(windows[0].step_seconds, [0.1, 0.1])
    for _ in range(5):  # 10 steps/s measured -> 0.5 s is 5 steps
        timed_step(0.025)
    assert [w.steps for w in windows] == [2, 5]
    for _ in range(20):  # 40 steps/s -> 20 steps
        timed_step(0.05)
    assert [w.steps for w in windows] == [2, 5, 20]


def test_window_steps_caps_a_time_window():
    probe, windows = _probe(window_steps=4, window_seconds=100.0)
    for _ in range(12):
        _step(probe, 1, [1, 1, 0, 0], [1, 1, 0, 0, 0, 0])
    assert [w.steps for w in windows] == [4, 4, 4]


def test_bad_setup_names_the_field():
    cfg = ProbeConfig(num_layers=1, num_experts=2, num_slots=3, top_k=1, hidden_bytes=4)
    with pytest.raises(ValueError, match="num_slots"):
        Probe(cfg, world_size=2)
    probe = Probe(ProbeConfig(num_layers=1, num_experts=2, num_slots=2, top_k=1, hidden_bytes=4))
    with pytest.raises(ValueError, match="physical_to_logical_map"):
        probe.set_placement(1, [[0, 1, 0]], [0.0])


def test_long_windows_fold_pending_counts_without_losing_any():
    probe, windows = _probe(window_steps=Probe.FOLD_STEPS * 2 + 5)
    for step in range(Probe.FOLD_STEPS * 2 + 5):
        if step % 2:  # a dropped pair (one fewer computed) and a rerouted one
            _step(probe, 5, [4, 3, 2, 1], [2, 3, 2, 1, 1, 0], dropped=[1, 0, 0, 0], rerouted=[0, 1, 0, 0])
        else:
            _step(probe, 5, [4, 3, 2, 1], [2, 3, 2, 1, 2, 0])
    assert probe.windows_invalid == 0, probe.last_error
    (window,) = windows
    steps = Probe.FOLD_STEPS * 2 + 5
    np.testing.assert_array_equal(window.expert_tokens, [[4 * steps, 3 * steps, 2 * steps, steps]] * L)
    np.testing.assert_array_equal(window.dropped_tokens, [[steps // 2, 0, 0, 0]] * L)
    np.testing.assert_array_equal(window.rerouted_tokens, [[0, steps // 2, 0, 0]] * L)


def test_count_topk_counts_real_tokens_only():
    probe, _ = _probe()
    ids = torch.tensor([[0, 1], [1, 2], [3, 0]])
    counts = probe.count_topk(ids, valid=torch.tensor([True, False, True]))
    assert counts.tolist() == [2, 1, 0, 1]
