"""The no-sync step clock (runtime/engines/clock.py) on the CPU, with a stand-in event that fails the
test if anything waits on it: only query() may be asked, and elapsed_time only of events whose
query() has answered True."""

from __future__ import annotations

import logging

import pytest
import torch

from moewatch.runtime.engines import common
from moewatch.runtime.engines.clock import EventClock


class Device:
    """A device that runs behind the host: `now` is how far it has got (in ms of device time)."""

    def __init__(self):
        self.now = 0.0
        self.host = 0.0  # device time at which the next recorded event will be passed


class StandInEvent:
    def __init__(self, device: Device):
        self.device = device
        self.at: float | None = None
        self.seen_done = False

    def record(self):
        self.at = self.device.host

    def query(self) -> bool:
        done = self.at is not None and self.device.now >= self.at
        self.seen_done = self.seen_done or done
        return done

    def elapsed_time(self, end: "StandInEvent") -> float:
        if not (self.seen_done or self.query()) or not end.seen_done:
            pytest.fail("elapsed_time read before query() said the events completed (it would wait)")
        return end.at - self.at

    def synchronize(self):
        pytest.fail("the clock waited on an event (synchronize)")

    def wait(self, stream=None):
        pytest.fail("the clock made a stream wait on an event")


def steps(clock: EventClock, device: Device, durations_ms):
    for ms in durations_ms:
        clock.begin_step()
        device.host += ms
        clock.end_step()


def test_only_completed_steps_are_read_in_order_and_nothing_waits():
    device = Device()
    clock = EventClock(lambda: StandInEvent(device))
    steps(clock, device, [4.0, 6.0, 10.0])
    assert clock.harvest() == [] and clock.pending == 3  # the device has not started
    device.now = 10.0  # two steps done, the third running
    assert clock.harvest() == pytest.approx([0.004, 0.006])
    assert clock.harvest() == [] and clock.pending == 1
    device.now = 100.0
    assert clock.harvest() == pytest.approx([0.010])


def test_pending_steps_are_bounded():
    device = Device()
    clock = EventClock(lambda: StandInEvent(device), max_pending=2)
    steps(clock, device, [1.0] * 5)
    assert clock.pending == 2 and clock.dropped == 3
    device.now = 5.0
    assert clock.harvest() == pytest.approx([0.001, 0.001])


def test_a_failure_turns_timing_off_with_one_warning(caplog):
    device = Device()
    made = [0]

    def factory():
        made[0] += 1
        if made[0] == 3:
            raise RuntimeError("no timing events on this device")
        return StandInEvent(device)

    clock = EventClock(factory)
    with caplog.at_level(logging.WARNING, logger="moewatch.runtime.engines.clock"):
        steps(clock, device, [1.0] * 4)
        device.now = 10.0
        assert clock.harvest() == []
    assert not clock.enabled and "no timing events" in clock.error
    assert sum("device step timing is off" in r.message for r in caplog.records) == 1


def recorder(device: Device, window_steps: int, seen: list, hold_steps: int | None = None):
    rec = common.EngineRecorder(common.EngineSettings(window_steps=window_steps), runtime="vllm", model="m",
                                top_k=1, hidden_bytes=4, num_experts=2, weights=common.PairWeights(4, 1, "cpu"),
                                sinks=[seen.append], clock=EventClock(lambda: StandInEvent(device)))
    if hold_steps is not None:
        rec.HOLD_STEPS = hold_steps
    return rec, rec.counter(0)


def run(rec, counter, device, durations_ms):
    for ms in durations_ms:
        rec.begin_step(1)
        counter.add(torch.tensor([[1]]))
        device.host += ms
        rec.end_step()


def test_a_window_waits_for_its_step_times_then_carries_them():
    device, seen = Device(), []
    rec, counter = recorder(device, window_steps=2, seen=seen)
    run(rec, counter, device, [3.0, 5.0])
    assert seen == []  # held: its events are not complete
    device.now = 8.0
    run(rec, counter, device, [2.0])  # the next step's end harvests them
    assert len(seen) == 1 and list(seen[0].step_seconds) == pytest.approx([0.003, 0.005])
    assert int(seen[0].expert_tokens.sum()) == 2 and seen[0].steps == 2
    device.now = 1000.0
    run(rec, counter, device, [7.0])
    device.now = 2000.0
    rec.close()
    assert len(seen) == 2 and list(seen[1].step_seconds) == pytest.approx([0.002, 0.007])


def test_a_window_held_too_long_goes_without_times_and_later_ones_stay_aligned():
    device, seen = Device(), []
    rec, counter = recorder(device, window_steps=2, seen=seen, hold_steps=3)
    run(rec, counter, device, [1.0, 1.0])  # window A, never completes while held
    run(rec, counter, device, [2.0, 2.0])  # window B
    run(rec, counter, device, [3.0])  # A held for 3 steps: sent without times
    assert len(seen) == 1 and seen[0].step_seconds is None and "steps" in seen[0].missing_evidence
    device.now = 1e6
    run(rec, counter, device, [4.0])  # now everything completes: B gets B's times, not A's
    assert len(seen) == 3
    assert list(seen[1].step_seconds) == pytest.approx([0.002, 0.002])
    assert list(seen[2].step_seconds) == pytest.approx([0.003, 0.004])


def test_without_a_clock_or_with_it_off_windows_go_at_once_without_device_times():
    device, seen = Device(), []
    rec, counter = recorder(device, window_steps=1, seen=seen)
    rec.clock._off(RuntimeError("test"))
    run(rec, counter, device, [1.0])
    assert len(seen) == 1 and seen[0].step_seconds is None
