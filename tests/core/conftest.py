"""Hand-built windows: one layer, one expert per rank, so every derived number can be checked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from moewatch.telemetry import Window


def build_window(traffic, dispatch, combine, compute, *, layer_extra=0.0, dropped=None, rerouted=None,
                 capacity_factor=0.0, hidden_bytes=8192, steps=1, top_k=1, step_tokens=None, **overrides) -> Window:
    """A one-layer window on W ranks with expert r on rank r (E = P = W).

    traffic: [W, W] pairs from rank i's tokens to expert/rank j (after capacity).
    dispatch, combine, compute: [W] seconds per rank, summed over the window's steps.
    dropped / rerouted: [W] pairs per expert; dropped ones are added to expert_tokens (routed before capacity).
    """
    traffic = np.asarray(traffic, dtype=np.int64)
    W = traffic.shape[0]
    dispatch, combine, compute = (np.asarray(x, dtype=np.float64) for x in (dispatch, combine, compute))
    dropped = np.zeros(W, np.int64) if dropped is None else np.asarray(dropped, np.int64)
    rerouted = np.zeros(W, np.int64) if rerouted is None else np.asarray(rerouted, np.int64)
    slot = traffic.sum(axis=0)
    local = np.diag(traffic).copy()
    total = int(slot.sum() + dropped.sum())
    fields = dict(
        runtime="test", model="m", ep_group="g", world_size=W, ranks_per_node=W, num_layers=1,
        num_experts=W, num_slots=W, top_k=top_k, epoch=0, steps=steps, start_time=100.0, end_time=101.0,
        hidden_bytes=hidden_bytes, physical_to_logical_map=[list(range(W))], expert_tokens=[slot + dropped],
        slot_tokens=[slot], dropped_tokens=[dropped], rerouted_tokens=[rerouted],
        capacity_factor=[capacity_factor], local_tokens=[local], sent_tokens=[traffic.sum(axis=1) - local],
        received_tokens=[slot - local], traffic=[traffic], dispatch_seconds=[dispatch], combine_seconds=[combine],
        compute_seconds=[compute], layer_seconds=[dispatch + combine + compute + layer_extra],
        step_seconds=[float((dispatch + combine + compute).max()) / steps] * steps,
        step_tokens=step_tokens if step_tokens is not None else [max(total // top_k // steps, 1)] * steps,
    )
    fields.update(overrides)
    return Window(**fields)


def uniform_traffic(W: int, per_pair: int) -> np.ndarray:
    """Every rank sends `per_pair` pairs to every rank (itself included): balanced, cross ratio 1 - 1/W."""
    return np.full((W, W), per_pair, dtype=np.int64)


@pytest.fixture
def hand():
    """The builders as a fixture (test modules import nothing from each other)."""

    class Builders:
        window = staticmethod(build_window)
        uniform = staticmethod(uniform_traffic)

    return Builders
