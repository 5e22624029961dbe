"""Derived quantities computed for every layer at once equal the per-layer forms they replaced.

The references below are the forms as they were before the agent's per-window CPU work (a loop per
layer, an [L, E, W] table); the vectorised ones must give the same values, so the diagnoses and the
exported series are unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

from moewatch import telemetry as tm
from moewatch import topology
from moewatch.planner.placement_math import holder_counts, holders
from moewatch.tools.examples import SCENARIOS, production_window, scenario, simulate


def ref_hot_experts(expert_tokens, multiple):
    out = []
    for row in expert_tokens:
        mean = row.mean()
        hot = np.flatnonzero(row > multiple * mean) if mean > 0 else np.array([], dtype=int)
        out.append([int(e) for e in hot[np.argsort(-row[hot], kind="stable")]])
    return out


def ref_expected_cross_rank_ratio(w):
    L, E, W = w.num_layers, w.num_experts, w.world_size
    holds = np.zeros((L, E, W), dtype=bool)
    holds[np.repeat(np.arange(L), w.num_slots), w.physical_to_logical_map.ravel(), np.tile(w.slot_rank, L)] = True
    kept = tm.kept_tokens(w)
    total = kept.sum(axis=1)
    expected_local = tm._ratio((kept * (holds.sum(axis=2) / W)).sum(axis=1), total)
    return np.where(total > 0, 1.0 - expected_local, 1.0 - 1.0 / W)


def windows():
    rng = np.random.default_rng(5)
    for i, name in enumerate(SCENARIOS):
        yield simulate(scenario(name, extra_slots=int(rng.choice([0, 4]))), seed=i)
    for seed in range(3):
        yield production_window(seed, num_layers=6, num_experts=64, num_slots=80, world_size=16, steps=2)
    tokens = rng.integers(0, 4, size=(5, 16))  # many ties, and an idle layer
    tokens[2] = 0
    tokens[3, ::3] = 40
    yield production_window(0, num_layers=5, num_experts=16, num_slots=16, world_size=4).replace(
        expert_tokens=tokens, dropped_tokens=None, rank_tokens=None, slot_tokens=None, traffic=None,
        local_tokens=None, sent_tokens=None, received_tokens=None)


@pytest.mark.parametrize("window", list(windows()), ids=lambda w: f"{w.runtime}-{w.num_layers}x{w.num_experts}")
def test_per_window_forms_equal_the_per_layer_ones(window):
    for multiple in (1.5, 2.0, 3.0):
        assert tm.hot_experts(window.replace(), multiple) == ref_hot_experts(window.expert_tokens, multiple)
    assert np.array_equal(tm.expected_cross_rank_ratio(window.replace()), ref_expected_cross_rank_ratio(window))


def test_holder_counts_equal_the_holders_table():
    rng = np.random.default_rng(3)
    for _ in range(200):
        E, groups, size = int(rng.integers(1, 9)), int(rng.integers(1, 6)), int(rng.choice([1, 2, 3, 5, 16, 17, 40]))
        pmap = rng.integers(0, E, size=(int(rng.integers(1, 4)), groups * size))  # an expert twice in a group too
        assert np.array_equal(holder_counts(pmap, E, groups), (holders(pmap, E, groups) > 0).sum(axis=2))


@pytest.mark.parametrize("idle_rank", [False, True])
def test_pair_seconds_relative_takes_the_median_of_the_known_ranks(idle_rank):
    w = production_window(1, num_layers=4, num_experts=32, num_slots=32, world_size=8)
    totals = w.slot_tokens.reshape(4, 8, -1).sum(axis=2)
    if idle_rank:
        totals[1, 0] = 0  # rank 0 computed nothing in layer 1: unknown, left out of that layer's median
    w = w.replace(rank_tokens=totals, slot_tokens=None, expert_tokens=None, dropped_tokens=None, rerouted_tokens=None,
                  traffic=None,
                  local_tokens=None, sent_tokens=None, received_tokens=None)
    load = tm.rank_load(w)
    per_pair = np.where(load > 0, w.compute_seconds / np.where(load > 0, load, 1), np.nan)
    expected = per_pair / np.nanmedian(per_pair, axis=1, keepdims=True)
    got = tm.pair_seconds_relative(w)
    assert np.isnan(got[1, 0]) == idle_rank and np.array_equal(got, expected, equal_nan=True)


def test_cross_node_ratio_of_counts_equals_the_product_form():
    rng = np.random.default_rng(8)
    for world, per_node in ((4, 2), (8, 2), (8, 4), (64, 8), (6, 3), (6, 4)):
        traffic = rng.integers(0, 50, size=(3, world, world))
        traffic[1] = 0  # an idle layer
        total = traffic.sum(axis=(1, 2)).astype(np.float64)
        crossed = topology.cross_node_pairs(traffic, per_node).astype(np.float64)
        expected = np.divide(crossed, total, out=np.zeros_like(total), where=total > 0)
        assert np.array_equal(topology.cross_node_ratio(traffic, world, per_node, 3), expected)
