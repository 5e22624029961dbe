"""The non-blocking sender: hello first, frames out, plans in, drops counted, reconnects."""

from __future__ import annotations

import time

import torch

from moewatch import wire
from moewatch.plan import Plan
from moewatch.runtime.probe import Probe, ProbeConfig
from moewatch.runtime.sender import Sender
from moewatch.telemetry import Window


def _window(epoch: int = 0) -> Window:
    probe = Probe(ProbeConfig(num_layers=1, num_experts=2, num_slots=2, top_k=1, hidden_bytes=8, window_steps=1))
    probe.set_placement(epoch, [[0, 1]], [0.0])
    probe.begin_step(3)
    probe.record_layer(0, torch.tensor([2, 1]), torch.tensor([2, 1]))
    return probe.end_step()


def test_hello_first_then_frames_and_plans_come_back(fake_agent, tmp_path, sender_kit):
    plans = []
    agent = fake_agent()
    sender = Sender(agent.path, sender_kit.hello, on_plan=plans.append, heartbeat_seconds=0.05,
                    heartbeat=lambda: wire.Heartbeat(time=time.time(), epoch=0, step=1)).start()
    try:
        assert sender_kit.wait(lambda: agent.messages)
        assert isinstance(agent.messages[0][1], wire.Hello)
        assert agent.messages[0][1].capabilities == ("plan", "capacity")
        assert sender.send_window(_window())
        sender.send_control(wire.Ack(plan_epoch=1, epoch_in_force=1, ok=True))
        assert sender_kit.wait(lambda: agent.of_type(Window) and agent.of_type(wire.Ack) and agent.of_type(wire.Heartbeat))
        agent.send(Plan(4, [[1, 0]], [0.0]))
        assert sender_kit.wait(lambda: plans)
        assert plans[0].epoch == 4 and sender.stats.plans_received == 1
    finally:
        stats = sender.close()
    assert stats.frames_dropped == 0 and stats.connects == 1


def test_absent_agent_costs_drops_not_waits_and_is_picked_up_later(fake_agent, tmp_path, sender_kit):
    path = tmp_path / "late.sock"
    sender = Sender(str(path), sender_kit.hello, queue_size=3, backoff_initial=0.01, backoff_max=0.05).start()
    try:
        kept = [sender.send_window(_window(epoch)) for epoch in range(5)]
        assert kept == [True, True, True, False, False]  # the two oldest made room
        assert sender.stats.windows_dropped == 2
        assert sender_kit.wait(lambda: sender.stats.connect_failures >= 2)
        agent = fake_agent(name="late.sock")
        assert sender_kit.wait(lambda: len(agent.of_type(Window)) == 3)
        assert isinstance(agent.messages[0][1], wire.Hello)
        assert [w.epoch for w in agent.of_type(Window)] == [2, 3, 4]  # the freshest survived
    finally:
        sender.close()


def test_reconnects_with_a_new_hello_after_the_agent_drops_it(fake_agent, sender_kit):
    agent = fake_agent()
    sender = Sender(agent.path, sender_kit.hello, backoff_initial=0.01).start()
    try:
        assert sender_kit.wait(lambda: agent.connections == 1 and agent.messages)
        agent.drop_connection()
        assert sender_kit.wait(lambda: agent.connections == 2 and any(i == 1 for i, _ in agent.messages))
        first_on_second = next(m for i, m in agent.messages if i == 1)
        assert isinstance(first_on_second, wire.Hello)
        sender.send_window(_window())
        assert sender_kit.wait(lambda: agent.of_type(Window))
    finally:
        stats = sender.close()
    assert stats.connects == 2 and stats.disconnects >= 1


def test_garbage_from_the_agent_is_counted_and_the_link_restarts(fake_agent, sender_kit):
    agent = fake_agent()
    sender = Sender(agent.path, sender_kit.hello, backoff_initial=0.01).start()
    try:
        assert sender_kit.wait(lambda: agent.messages)
        agent._conn.sendall(b"XX not a frame at all")
        assert sender_kit.wait(lambda: sender.stats.frames_rejected == 1 and agent.connections == 2)
    finally:
        sender.close()
    assert sender.stats.plans_received == 0
