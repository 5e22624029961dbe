"""The runtime reaches an agent on another node: `--socket tcp://HOST:PORT` (or MOEWATCH_SOCKET), the
same frames as over the unix socket, checked against a loopback TCP listener that decodes them."""

from __future__ import annotations

import time

import pytest

from moewatch import wire
from moewatch.plan import Plan
from moewatch.runtime.config import ConfigError, RuntimeConfig, validate
from moewatch.runtime.sender import Sender, agent_address


@pytest.mark.parametrize("text, expected", [
    ("/run/moewatch/moewatch.sock", ("unix", "/run/moewatch/moewatch.sock")),
    ("tcp://10.0.0.7:7071", ("tcp", ("10.0.0.7", 7071))),
    ("tcp://agent.ep0.svc:7071", ("tcp", ("agent.ep0.svc", 7071))),
    ("tcp://[::1]:7071", ("tcp", ("::1", 7071))),
])
def test_agent_address_forms(text, expected):
    assert agent_address(text) == expected


@pytest.mark.parametrize("text", ["", "tcp://host", "tcp://:7071", "tcp://host:0", "tcp://host:70000",
                                  "tcp://host:port", "/tmp/" + "s" * 120])
def test_bad_addresses_are_refused_naming_the_field(text):
    with pytest.raises(ValueError):
        agent_address(text)
    with pytest.raises(ConfigError) as caught:
        validate(RuntimeConfig(socket=text))
    assert caught.value.field == "socket"


def test_frames_go_out_and_plans_come_back_over_tcp(fake_agent, sender_kit):
    agent = fake_agent(tcp=True)
    assert agent.path.startswith("tcp://127.0.0.1:")
    plans = []
    sender = Sender(agent.path, sender_kit.hello, on_plan=plans.append, heartbeat_seconds=0.05,
                    heartbeat=lambda: wire.Heartbeat(time=time.time(), epoch=0, step=1)).start()
    try:
        assert sender_kit.wait(lambda: agent.messages)
        assert isinstance(agent.messages[0][1], wire.Hello), "hello first"
        sender.send_control(wire.Ack(plan_epoch=1, epoch_in_force=1, ok=True))
        assert sender_kit.wait(lambda: agent.of_type(wire.Ack) and agent.of_type(wire.Heartbeat))
        agent.send(Plan(3, [[1, 0]], [0.0]))
        assert sender_kit.wait(lambda: plans)
        assert plans[0].epoch == 3
        # The agent goes away and comes back: a new connection, a new hello.
        agent.drop_connection()
        assert sender_kit.wait(lambda: agent.connections == 2 and len(agent.of_type(wire.Hello)) == 2)
    finally:
        stats = sender.close()
    assert stats.connects == 2 and stats.frames_rejected == 0
