"""A group that spans nodes: the triage reports its cross-node traffic, /metrics carries it per layer,
the policy solves node-aware and its cost gate prices migration at the slower inter-node link."""

from __future__ import annotations

import dataclasses

import pytest

from moewatch import topology
from moewatch.agent import policy
from moewatch.agent.config import AgentConfig
from moewatch.agent.metrics.state import MetricsState
from moewatch.agent.metrics.windows import GroupExportMemory, record_window
from moewatch.agent.params import from_config
from moewatch.agent.store import TriagedWindow
from moewatch.planner import placement_math as pm
from moewatch.triage import diagnose

W, L, E, P = 4, 2, 8, 12  # 2 nodes of 2 ranks
HOT = 5


def cfg(**sections):
    """The decision parameters of a config in act mode with K = 3, each keyword a section over it."""
    return from_config(AgentConfig.from_mapping({"policy": {"mode": "act", "persist_windows": 3}}, **sections))


def two_node_windows(helpers, n=3):
    # Expert 5 is hot and has one slot (5, on rank 1: node 0); experts 0-3 have a slot on each node.
    load = helpers.hot_load(L, E, hot=HOT)
    pmap = helpers.contiguous(L, E, P)
    out = []
    for i in range(n):
        w = dataclasses.replace(helpers.make_window(load, pmap, W, start_time=1000.0 + 10 * i), ranks_per_node=2)
        out.append(TriagedWindow(w, diagnose(w), 0.0))
    return out


def view(windows, num_nodes=2):
    return policy.GroupView(num_gpus=W, num_nodes=num_nodes, num_experts=E, num_slots=P,
                            capabilities=frozenset({"plan", "capacity"}), windows=windows)


def test_triage_and_metrics_report_cross_node_traffic_per_layer(helpers):
    t = two_node_windows(helpers, 1)[0]
    w = t.window
    expected = topology.cross_node_ratio(w.traffic, W, 2, L)
    assert (expected > 0).all()
    for d in t.diagnosis.layers:
        assert d.metrics["cross_node_ratio"] == expected[d.layer]
        assert any("cross nodes over the inter-node (RDMA) link (2 nodes of 2 ranks)" in e for e in d.evidence)
    state = MetricsState()
    record_window(state, GroupExportMemory(), w, t.diagnosis, expert_metrics=False)
    for layer in range(L):
        labels = (w.model, w.ep_group, str(layer))
        assert state.get("moewatch_layer_cross_node_ratio", labels) == expected[layer]
        assert state.get("moewatch_layer_seconds_at_stake", labels) == t.diagnosis.layers[layer].seconds_at_stake > 0
    # The same traffic on one node crosses nothing, and the triage does not speak of nodes.
    single = dataclasses.replace(w, ranks_per_node=W)
    diag = diagnose(single)
    assert all(d.metrics["cross_node_ratio"] == 0.0 for d in diag.layers)
    assert not any("cross nodes" in e for d in diag.layers for e in d.evidence)


def test_plan_is_node_aware_and_priced_at_the_inter_node_link(helpers):
    windows = two_node_windows(helpers)
    fast = policy.decide(view(windows), cfg(cost={"inter_node_bandwidth_bytes_per_second": 5e10}).policy, now=0.0)
    assert fast.has_plan
    counts_per_node = pm.holders(fast.physical_to_logical_map, E, 2)  # [L, E, nodes]
    assert (counts_per_node[:, HOT, :] > 0).all(), "the hot expert has a replica on every node"
    d = next(d for d in fast.decisions if d.result == "proposed")
    assert d.after["num_nodes"] == 2 and "node-aware, 2 nodes" in d.reason
    assert d.after["model_cross_node_ratio"] < d.before["model_cross_node_ratio"]
    moved = d.after["slots_moved"]
    stall_fast = d.after["predicted_stall_seconds"]
    assert stall_fast == pytest.approx(moved * cfg().policy.cost.expert_bytes / 5e10)
    # The same plan over a slow inter-node link costs more, and past the gain it does not pay.
    slow_cfg = cfg(cost={"inter_node_bandwidth_bytes_per_second": 1e3})
    slow = policy.decide(view(windows), slow_cfg.policy, now=0.0)
    assert not slow.has_plan
    skipped = [d for d in slow.decisions if d.kind in ("replicate", "placement")]
    assert skipped and all(d.result == "skipped" and "does not pay" in d.reason for d in skipped)
    assert all(d.after["predicted_stall_seconds"] > 1000 * stall_fast for d in skipped)
    # One node: the inter-node bandwidth plays no part.
    assert policy.decide(view(windows, num_nodes=1), slow_cfg.policy, now=0.0).has_plan
