"""The engine recorder's flush and sending (runtime/engines/common.py, readout.py) on the CPU:
- the step path makes no host read of a device tensor: the flush starts one non-blocking copy of
  every layer's counters and records an event; the window is built only once a later look finds the
  event complete (stand-in events of a device that runs behind the host: test_clock.py's);
- counters are cumulative and differenced, so pairs added while a copy is in flight go to the next
  window, none lost, none counted twice;
- a window whose seconds are up is sent by the recorder's timer while the engine is idle, and so is
  a window waiting for its device events;
- a window that cannot be built or sent is counted by reason, logged once per reason, reported in
  the sender's heartbeats and exported by the agent as moewatch_runtime_windows_lost_total."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_clock import Device, StandInEvent

from moewatch.runtime.engines import common
from moewatch.runtime.engines.clock import EventClock
from moewatch.runtime.engines.readout import HostReadout


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class HostReads:
    """Fails the test on any host read of a tensor (what makes the host wait on a device) while armed:
    .cpu(), .numpy(), .item(), .tolist(), a blocking copy_, or `.to("cpu")`."""

    def __init__(self, monkeypatch):
        self.armed = False
        self.copies: list[bool] = []  # non_blocking of each copy_ made while armed
        for name in ("cpu", "numpy", "item", "tolist"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._guard(name, original))
        copy = torch.Tensor.copy_

        def guarded_copy(tensor, src, non_blocking=False):
            if self.armed:
                self.copies.append(non_blocking)
                if not non_blocking:
                    pytest.fail("a blocking copy_ on the step path")
            return copy(tensor, src, non_blocking)

        monkeypatch.setattr(torch.Tensor, "copy_", guarded_copy)

    def _guard(self, name, original):
        def guarded(tensor, *args, **kwargs):
            if self.armed:
                pytest.fail(f"Tensor.{name}() on the step path (a host sync on a device)")
            return original(tensor, *args, **kwargs)
        return guarded


def recorder_on_a_slow_device(device: Device, seen: list, *, window_steps: int | None = 2, layers: int = 3,
                              window_seconds: float | None = None, timer: bool = False):
    rec = common.EngineRecorder(common.EngineSettings(window_steps=window_steps, window_seconds=window_seconds),
                                runtime="vllm", model="m", top_k=1, hidden_bytes=4, num_experts=4,
                                weights=common.PairWeights(8, 1, "cpu"), sinks=[seen.append], timer=timer)
    # The asynchronous (GPU) copy path, with events of a device that runs behind the host.
    rec.readout = HostReadout("cpu", event_factory=lambda: StandInEvent(device))
    return rec, [rec.counter(i) for i in range(layers)]


def step(rec, counters, expert: int, tokens: int = 1, reads: "HostReads | None" = None):
    """One engine step; with `reads`, the recorder's own calls are watched for host reads."""
    if reads is not None:
        reads.armed = True
    rec.begin_step(tokens)
    if reads is not None:
        reads.armed = False
    for counter in counters:  # the engine's forward
        counter.add(torch.full((tokens, 1), expert))
    if reads is not None:
        reads.armed = True
    try:
        return rec.end_step()
    finally:
        if reads is not None:
            reads.armed = False


def test_end_step_reads_nothing_on_the_host_and_the_window_waits_for_its_one_copy(monkeypatch):
    device, seen = Device(), []
    rec, counters = recorder_on_a_slow_device(device, seen)
    reads = HostReads(monkeypatch)
    device.host = 1.0  # every event recorded from now on is passed when the device reaches 1.0
    step(rec, counters, expert=0, reads=reads)
    step(rec, counters, expert=1, reads=reads)  # ends the window: its flush starts the copy
    assert seen == [] and rec.readout.copies == 1  # one copy for the 3 layers
    assert reads.copies == [True]  # ... non-blocking
    step(rec, counters, expert=2, reads=reads)  # the device has not got there: nothing read, nothing sent
    assert seen == []
    device.now, device.host = 1.0, 2.0
    step(rec, counters, expert=3)  # the next step's end finds the first copy complete (the second not)
    assert len(seen) == 1 and seen[0].steps == 2
    assert seen[0].expert_tokens.tolist() == [[1, 1, 0, 0]] * 3


def test_pairs_added_while_a_copy_is_in_flight_go_to_the_next_window_none_lost_none_twice():
    device, seen = Device(), []
    rec, counters = recorder_on_a_slow_device(device, seen, window_steps=2, layers=2)
    device.host = 1.0
    step(rec, counters, expert=0)
    step(rec, counters, expert=0, tokens=2)  # window 1's copy starts, not complete
    device.host = 2.0
    step(rec, counters, expert=1, tokens=3)  # added while window 1's copy is in flight
    step(rec, counters, expert=2)  # window 2's copy starts
    device.now = 2.0
    device.host = 3.0
    step(rec, counters, expert=3)
    device.now = 3.0
    rec.close()  # window 3 (one step)
    assert [w.steps for w in seen] == [2, 2, 1]
    assert [w.expert_tokens.tolist() for w in seen] == [[[3, 0, 0, 0]] * 2, [[0, 3, 1, 0]] * 2, [[0, 0, 0, 1]] * 2]
    assert sum(int(w.expert_tokens.sum()) for w in seen) == 2 * (1 + 2 + 3 + 1 + 1)


def test_an_idle_engines_window_is_sent_by_the_timer_once_its_seconds_are_up():
    seen = []
    rec = common.EngineRecorder(common.EngineSettings(window_steps=None, window_seconds=0.2), runtime="vllm",
                                model="m", top_k=1, hidden_bytes=4, num_experts=2,
                                weights=common.PairWeights(4, 1, "cpu"), sinks=[seen.append])
    counter = rec.counter(0)
    try:
        for _ in range(2):
            rec.begin_step(1)
            counter.add(torch.tensor([[1]]))
            rec.end_step()
        assert seen == []  # its 0.2 s are not up yet
        # No further step: the engine is idle. The timer ends the window and sends it.
        assert wait_until(lambda: len(seen) == 1, timeout=10.0)
        assert seen[0].steps == 2 and seen[0].expert_tokens.tolist() == [[0, 2]]
    finally:
        rec.close()
    assert len(seen) == 1  # nothing left for shutdown


def test_a_window_waiting_for_its_device_events_is_sent_by_the_timer_when_they_complete():
    device, seen = Device(), []
    rec = common.EngineRecorder(common.EngineSettings(window_steps=2), runtime="vllm", model="m", top_k=1,
                                hidden_bytes=4, num_experts=2, weights=common.PairWeights(4, 1, "cpu"),
                                sinks=[seen.append], clock=EventClock(lambda: StandInEvent(device)))
    rec.readout = HostReadout("cpu", event_factory=lambda: StandInEvent(device))
    counter = rec.counter(0)
    try:
        for ms in (3.0, 5.0):
            rec.begin_step(1)
            counter.add(torch.tensor([[0]]))
            device.host += ms
            rec.end_step()
        assert seen == []  # the device has not finished: held
        device.now = 100.0  # it finishes while no step comes
        assert wait_until(lambda: len(seen) == 1, timeout=10.0)
        assert list(seen[0].step_seconds) == pytest.approx([0.003, 0.005])
        assert seen[0].expert_tokens.tolist() == [[2, 0]]
    finally:
        rec.close()


def invalid_recorder(seen, **settings):
    """A recorder whose every window fails validation: its slot map names expert 9 of 4 (the sizes,
    and so the sender's hello, are sound)."""
    rec = common.EngineRecorder(common.EngineSettings(window_steps=1, **settings), runtime="vllm", model="m",
                                top_k=1, hidden_bytes=4, num_experts=4, weights=common.PairWeights(4, 1, "cpu"),
                                sinks=[seen.append], timer=False)
    rec.slot_map = lambda: np.array([[0, 1, 2, 9]])
    return rec, rec.counter(0, num_slots=4)


def test_windows_that_fail_validation_are_counted_by_reason_and_logged_once(caplog):
    seen = []
    rec, counter = invalid_recorder(seen)
    with caplog.at_level(logging.WARNING, logger="moewatch.runtime.engines.common"):
        for _ in range(3):
            rec.begin_step(1)
            counter.add(torch.tensor([[1]]))
            assert rec.end_step() is None
    assert seen == [] and rec.windows_lost() == {"invalid": 3}
    warnings = [r for r in caplog.records if "window was lost" in r.message]
    assert len(warnings) == 1 and "invalid" in warnings[0].message and "physical_to_logical_map" in warnings[0].message
    assert rec.heartbeat().extra == {"windows_lost": {"invalid": 3}}


def test_a_failing_sink_is_counted_and_the_step_goes_on(caplog):
    def full_disk(window):
        raise OSError(28, "No space left on device")

    seen = []
    rec = common.EngineRecorder(common.EngineSettings(window_steps=1), runtime="vllm", model="m", top_k=1,
                                hidden_bytes=4, num_experts=2, weights=common.PairWeights(4, 1, "cpu"),
                                sinks=[full_disk, seen.append], timer=False)
    counter = rec.counter(0)
    with caplog.at_level(logging.WARNING, logger="moewatch.runtime.engines.common"):
        for _ in range(2):
            rec.begin_step(1)
            counter.add(torch.tensor([[1]]))
            rec.end_step()
    assert len(seen) == 2  # the other sink still got every window
    assert rec.windows_lost() == {"sink_error": 2}
    assert sum("window was lost" in r.message for r in caplog.records) == 1


def test_the_sender_counts_windows_it_drops_by_reason():
    from moewatch.runtime.sender import Sender

    sender = Sender("/nonexistent/agent.sock", hello=lambda: None, queue_size=2)  # never started
    window = object()
    for _ in range(5):
        sender.send_window(window)
    assert sender.stats.window_drops == {"queue_full": 3}
    sender.close(drain_seconds=0)
    assert sender.stats.window_drops == {"queue_full": 3, "unsent_at_close": 2}


def test_windows_lost_reach_the_agents_metrics_in_heartbeats():
    from moewatch.agent.config import AgentConfig
    from moewatch.agent.daemon import Daemon

    short = Path(tempfile.mkdtemp(prefix="mwl-", dir="/tmp"))
    sock = str(short / "agent.sock")
    daemon = Daemon(AgentConfig.from_mapping({
        "server": {"socket": sock, "listen": "127.0.0.1:0"}, "log": {"audit_log": str(short / "audit.jsonl")}})).start()
    rec = None
    try:
        seen = []
        rec, counter = invalid_recorder(seen, socket=sock)
        for _ in range(4):
            rec.begin_step(1)
            counter.add(torch.tensor([[1]]))
            rec.end_step()
        assert seen == [] and rec.windows_lost() == {"invalid": 4}
        # No window was ever valid: the sender still connects (its hello from the windows' sizes) and
        # its heartbeats carry the counts.
        got = lambda: daemon.metrics.get("moewatch_runtime_windows_lost_total", ("m", "ep0", "invalid"))  # noqa: E731
        assert wait_until(lambda: got() == 4, timeout=15.0), daemon.metrics.series("moewatch_runtime_windows_lost_total")
        import urllib.request
        with urllib.request.urlopen(daemon.http_url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert 'moewatch_runtime_windows_lost_total{ep_group="ep0",model="m",reason="invalid"} 4.0' in text
    finally:
        if rec is not None:
            rec.close()
        daemon.stop()
        shutil.rmtree(short, ignore_errors=True)


def test_the_agent_adds_each_processes_growth_with_a_bounded_reason_label():
    from moewatch.agent.metrics.groups import windows_lost_growth

    kept: dict = {}
    assert windows_lost_growth(kept, 10, {"invalid": 2}) == {"invalid": 2}
    assert windows_lost_growth(kept, 10, {"invalid": 2}) == {}  # a reconnect resending its count
    assert windows_lost_growth(kept, 11, {"invalid": 1, "made_up": 5}) == {"invalid": 1, "other": 5}
    assert windows_lost_growth(kept, 10, {"invalid": 3, "queue_full": 1}) == {"invalid": 1, "queue_full": 1}
    assert windows_lost_growth(kept, 10, {"invalid": -1}) == {} and windows_lost_growth(kept, 10, "x") == {}
    assert np.all([isinstance(v, dict) for v in kept.values()])
