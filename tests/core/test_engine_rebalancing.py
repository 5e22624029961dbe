"""What a rebalance by the engine's own policy did, for its record (moewatch.engine_rebalancing.observed_rebalance),
and the watch counting every recorded rebalance, whoever's policy answered it."""

from __future__ import annotations

import numpy as np

from moewatch.agent.rebalance_watchdog import rebalance_calls
from moewatch.engine_rebalancing import observed_rebalance


def test_the_layers_and_slots_that_changed_and_balancedness_before_and_after():
    load = np.array([[30, 10, 10, 10], [10, 10, 10, 10]])
    before = np.array([[0, 1, 2, 3, 1, 2], [0, 1, 2, 3, 0, 1]])
    after = np.array([[0, 1, 2, 3, 0, 2], [0, 1, 2, 3, 0, 1]])
    got = observed_rebalance(load, before, after, 2, expert_bytes=10.0)
    assert got["layers_changed"] == [0] and got["slots_moved"] == 1 and got["bytes_moved"] == 10.0
    assert got["map_changes"] == {"0": [before[0].tolist(), after[0].tolist()]}
    # layer 0: rank loads 30+5+5 | 10+5+5 before (0.75), 15+10+5 | 10+15+5 after (1.0); layer 1 1.0 both
    assert got["balancedness_before"] == (0.75 + 1.0) / 2 and got["balancedness_after"] == 1.0
    assert observed_rebalance(load, None, after, 2)["balancedness_before"] is None


def test_a_map_of_another_slot_count_or_with_empty_slots_is_not_compared():
    load = np.ones((1, 4))
    for before in (np.array([[0, 1, 2, 3]]), np.array([[0, 1, 2, 3, -1, -1]])):
        got = observed_rebalance(load, before, np.array([[0, 1, 2, 3, 0, 1]]), 2)
        assert got["balancedness_before"] is None and got["slots_moved"] == 6 and got["layers_changed"] == [0]
        assert got["bytes_moved"] is None


def test_every_record_naming_its_engine_is_a_rebalance_for_the_watch():
    extra = {"engine_rebalance": [{"engine": "e", "policy": "engine", "call": 0}, {"engine": "e", "fallback": True},
                                  {"engine": "e", "layer_outcomes": {}}, {"call": 3}, "not a record"]}
    assert rebalance_calls(extra) == 3 and rebalance_calls({}) == 0
