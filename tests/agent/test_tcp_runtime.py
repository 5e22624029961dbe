"""The runtime's own sender reaches the agent's TCP listener (issue 13, an agent on another node):
hello and windows go in, a plan comes back, over the same frames as the unix socket."""

from __future__ import annotations

import threading

import numpy as np

from moewatch import wire
from moewatch.runtime.sender import Sender

L, E, P, W = 2, 8, 12, 4


def test_runtime_sender_over_tcp_reaches_the_agent_and_gets_its_plan(start_agent, helpers):
    daemon = start_agent(server={"tcp_listen": "127.0.0.1:0"})
    plans, got_plan = [], threading.Event()

    def on_plan(plan):
        plans.append(plan)
        got_plan.set()

    hello = wire.Hello(runtime="moewatch-runtime", model="m", ep_group="tcp", world_size=W, num_layers=L,
                       num_experts=E, num_slots=P, ranks_per_node=W, capabilities=("plan",))
    sender = Sender(f"tcp://127.0.0.1:{daemon.receiver.tcp_port}", lambda: hello, on_plan=on_plan).start()
    try:
        group = helpers.wait_group(daemon, ("m", "tcp"))
        window = helpers.make_window(helpers.hot_load(L, E), helpers.contiguous(L, E, P), W, ep_group="tcp")
        sender.send_window(window)
        assert helpers.wait_for(lambda: len(group.history) == 1)
        target = helpers.contiguous(L, E, P)[:, ::-1].copy()
        daemon.controller.submit(group, target, np.zeros(L), "tcp end to end")
        assert got_plan.wait(10)
        assert plans[0].epoch == 1 and np.array_equal(plans[0].physical_to_logical_map, target)
    finally:
        sender.close()
