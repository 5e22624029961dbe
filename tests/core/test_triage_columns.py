"""layer_metrics converts each derived column once for all layers: equal, cell by cell, to converting
each layer's value on its own (the form it replaced, kept here as the reference)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moewatch import telemetry as tm
from moewatch.tools.bench.agent import full_evidence_window
from moewatch.tools.examples import production_window, without_evidence
from moewatch.triage import Thresholds, layer_metrics


def _cell(values, layer):
    if values is None:
        return None
    x = float(values[layer])
    return x if math.isfinite(x) else None


def reference_columns(w, t):
    """Per layer and cell, the conversions layer_metrics makes, one value at a time."""
    load = tm.rank_load(w)
    out = []
    for layer in range(w.num_layers):
        out.append({
            "a2a_share": _cell(tm.a2a_share(w), layer),
            "rank_load_max_min": _cell(tm.rank_load_max_min(w), layer),
            "effective_capacity_factor": _cell(tm.effective_capacity_factor(w), layer),
            "capacity_factor": _cell(w.capacity_factor, layer),
            "routed_pairs": None if w.expert_tokens is None else int(w.expert_tokens.sum(axis=1)[layer]),
            "dropped_pairs": None if w.dropped_tokens is None else int(w.dropped_tokens.sum(axis=1)[layer]),
            "rank_load": None if load is None else [int(x) for x in load[layer]],
            "busiest_rank": None if load is None else int(np.argmax(load[layer])),
        })
    return out


@pytest.mark.parametrize("make", [
    lambda: full_evidence_window(0, num_layers=6, num_experts=32, num_slots=40, world_size=8),
    lambda: production_window(1, num_layers=5, num_experts=16, num_slots=16, world_size=4, top_k=2),
    lambda: without_evidence(production_window(2, num_layers=4, num_experts=16, num_slots=16, world_size=4,
                                               top_k=2), ("expert_tokens",)),
    lambda: without_evidence(full_evidence_window(3, num_layers=4, num_experts=16, num_slots=16, world_size=4,
                                                  top_k=2), ("dispatch_seconds", "combine_seconds", "traffic")),
])
def test_layer_metrics_equal_the_per_cell_conversion(make):
    w = make()
    t = Thresholds()
    got = layer_metrics(w, t)
    for row, expected in zip(got, reference_columns(w, t), strict=True):
        for name, value in expected.items():
            assert row[name] == value and type(row[name]) is type(value), (name, row[name], value)

