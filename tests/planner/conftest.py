"""Shared fixtures for the planner tests."""

from __future__ import annotations

import numpy as np
import pytest

from moewatch.telemetry import Window


def _window_from_traffic(traffic, compute, dispatch, combine, *, ranks_per_node, hidden_bytes, steps):
    """A valid Window with expert r on rank r (E = P = W) and the given per-layer traffic [L, W, W]."""
    traffic = np.asarray(traffic, dtype=np.int64)
    L, W, _ = traffic.shape
    slot = traffic.sum(axis=1)
    local = np.diagonal(traffic, axis1=1, axis2=2).copy()
    zeros_le = np.zeros((L, W), dtype=np.int64)
    layer = np.asarray(compute) + np.asarray(dispatch) + np.asarray(combine)
    return Window(
        runtime="test", model="m", ep_group="g", world_size=W, ranks_per_node=ranks_per_node,
        num_layers=L, num_experts=W, num_slots=W, top_k=1, epoch=0, steps=steps, start_time=0.0,
        end_time=1.0, hidden_bytes=hidden_bytes, physical_to_logical_map=np.tile(np.arange(W), (L, 1)),
        expert_tokens=slot, slot_tokens=slot, dropped_tokens=zeros_le, rerouted_tokens=zeros_le,
        capacity_factor=np.zeros(L), local_tokens=local, sent_tokens=traffic.sum(axis=2) - local,
        received_tokens=slot - local, traffic=traffic, dispatch_seconds=dispatch, combine_seconds=combine,
        compute_seconds=compute, layer_seconds=layer, step_seconds=np.full(steps, float(layer.max())),
        step_tokens=np.full(steps, int(slot.sum() // max(steps, 1))),
    )


@pytest.fixture
def window_from_traffic():
    return _window_from_traffic


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
