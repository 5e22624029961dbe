"""The runtime under load with an agent on its socket: windows out, plans in, acks back, nothing lost.

One 4-rank gloo run. A stand-in agent answers the first window with a plan that moves experts and
changes a capacity factor, then sends the same epoch again (stale), then a plan whose migration is
made to fail on the last rank, then stops the runtime with SIGTERM to rank 0 (the Hello's pid).
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from moewatch import wire
from moewatch.plan import Plan
from moewatch.runtime.checks import replicated_placement
from moewatch.runtime.config import RuntimeConfig
from moewatch.runtime.launcher import launch
from moewatch.telemetry import Window

pytestmark = pytest.mark.slow

W, L, E, P = 4, 2, 8, 12


def test_plan_applied_under_load_changes_epoch_and_map_without_losing_a_pair(fake_agent):
    old_map = replicated_placement(L, E, P, seed=1)
    new_map = replicated_placement(L, E, P, seed=2)
    fail_map = replicated_placement(L, E, P, seed=3)
    sent, stopped = [], []

    def react(message, agent):
        if isinstance(message, Window) and not sent:
            sent.append(("move", message.steps))
            agent.send(Plan(1, new_map, [0.0, 1.5], reason="move and cap layer 1"))
        elif isinstance(message, wire.Ack) and message.ok and len(sent) == 1:
            sent.append(("stale", message.step))
            agent.send(Plan(1, old_map, [0.0, 0.0], reason="stale"))
        elif isinstance(message, wire.Ack) and not message.ok and len(sent) == 2:
            sent.append(("fail", message.step))
            agent.send(Plan(2, fail_map, [0.0, 0.0], reason="migration will fail on the last rank"))
        elif isinstance(message, wire.Ack) and len(sent) == 3:
            sent.append(("stop", message.step))
        # Stop once the third plan is answered and a heartbeat has come (every 0.2 s): on a quiet
        # machine the three plans can be answered before the first heartbeat is due.
        if len(sent) == 4 and not stopped and agent.of_type(wire.Heartbeat):
            stopped.append(True)
            os.kill(agent.messages[0][1].pid, signal.SIGTERM)  # rank 0 stops the group at a boundary

    agent = fake_agent(react)
    cfg = RuntimeConfig(ranks=W, layers=L, experts=E, slots=P, hidden=32, ffn=48, batch_tokens=32, steps=5000,
                        window_steps=4, socket=agent.path, overflow="reroute", zipf=1.2, pad_fraction=0.1,
                        placement=old_map.tolist(), inject_migration_failure={"rank": W - 1, "epoch": 2},
                        return_windows=True, heartbeat_seconds=0.2)
    result = launch(cfg)

    # The link: hello first, every window delivered, nothing dropped.
    hello = agent.messages[0][1]
    assert isinstance(hello, wire.Hello) and hello.world_size == W and "plan" in hello.capabilities
    received = agent.of_type(Window)
    assert result.sender["frames_dropped"] == 0
    assert [w.to_dict() for w in received] == result.windows
    assert agent.of_type(wire.Heartbeat)

    # The acks, in order: applied, stale refused, failed with epoch 1 kept.
    acks = agent.of_type(wire.Ack)
    assert [(a.plan_epoch, a.ok, a.epoch_in_force) for a in acks] == [(1, True, 1), (1, False, 1), (2, False, 1)]
    assert acks[0].layers_changed == L and acks[0].stall_seconds > 0
    assert "stale" in acks[1].error and f"failed ranks: [{W - 1}]" in acks[2].error
    assert (result.plans_applied, result.plans_refused, result.plans_failed) == (1, 1, 1)
    assert result.epoch == 1 and result.placement == new_map.tolist()

    # Windows: epoch 0 with the old map, then epoch 1 with the new map and capacity; never epoch 2.
    epochs = [w.epoch for w in received]
    assert epochs == sorted(epochs) and set(epochs) == {0, 1}
    for w in received:
        expected_map, expected_cap = (old_map, [0.0, 0.0]) if w.epoch == 0 else (new_map, [0.0, 1.5])
        np.testing.assert_array_equal(w.physical_to_logical_map, expected_map)
        np.testing.assert_array_equal(w.capacity_factor, expected_cap)
    assert acks[0].step >= received[0].steps  # applied while steps kept running after the first window
    capped = [w for w in received if w.epoch == 1]
    assert sum(int(w.rerouted_tokens[1].sum()) for w in capped) > 0 and all(w.rerouted_tokens[0].sum() == 0
                                                                            for w in capped)

    # No pair lost: every step in exactly one window, every routed pair computed or dropped.
    assert [kind for kind, _ in sent] == ["move", "stale", "fail", "stop"]
    assert sum(w.steps for w in received) == result.steps < 5000
    routed = sum(int(w.expert_tokens.sum()) for w in received)
    computed = sum(int(w.slot_tokens.sum()) for w in received)
    dropped = sum(int(w.dropped_tokens.sum()) for w in received)
    assert routed == result.pairs_routed == computed + dropped
    assert result.pairs_lost == 0 and result.pairs_computed == computed and result.pairs_dropped == dropped
    tokens = sum(int(w.step_tokens.sum()) for w in received)
    assert routed == tokens * cfg.top_k * L
    assert tokens == result.steps * W * (cfg.batch_tokens - 3)  # 10 % of 32 token slots are padding, never counted
