"""Capacity enforcement: the vectorised rule against a pair-by-pair recount, and its accounting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moewatch.capacity import expert_capacity
from moewatch.runtime.capacity import apply_capacity, group_ordinal


def test_capacity_formula():
    assert expert_capacity(0.0, 256, 2, 32) is None
    assert expert_capacity(1.25, 256, 2, 32) == 20
    assert expert_capacity(1.0, 100, 2, 32) == 7  # ceil(6.25)
    assert expert_capacity(1.1, 320, 1, 32) == 11  # 11.000000000000002 in floats, not 12


def test_group_ordinal():
    keys = torch.tensor([2, 0, 2, 2, 0])
    assert group_ordinal(keys, 3).tolist() == [0, 0, 1, 2, 1]
    assert group_ordinal(torch.tensor([], dtype=torch.long), 3).tolist() == []


def _case(seed: int, num_tokens: int, num_experts: int, top_k: int, skew: float, pad: float):
    rng = np.random.default_rng(seed)
    scores = torch.from_numpy(rng.random((num_tokens, num_experts)) * np.linspace(1.0, skew, num_experts))
    ids = torch.topk(scores, top_k, dim=1).indices
    valid = torch.from_numpy(rng.random(num_tokens) >= pad)
    return ids, valid, scores


@pytest.mark.parametrize("overflow", ["drop", "reroute"])
@pytest.mark.parametrize("seed", range(12))
def test_matches_pair_by_pair_recount(naive, overflow, seed):
    num_tokens, num_experts, top_k = 30 + seed, 6 + seed % 3, 1 + seed % 3
    ids, valid, scores = _case(seed, num_tokens, num_experts, top_k, skew=4.0, pad=0.15)
    cap = expert_capacity(0.5 + 0.25 * (seed % 4), int(valid.sum()), top_k, num_experts)
    got = apply_capacity(ids, valid, scores, cap, overflow)
    assigned, routed, dropped, rerouted = naive.capacity(ids.tolist(), valid.tolist(), scores.tolist(), cap, overflow)
    assert got.assigned.tolist() == assigned
    assert got.routed.tolist() == routed
    assert got.dropped.tolist() == dropped
    assert got.rerouted.tolist() == rerouted


@pytest.mark.parametrize("overflow", ["drop", "reroute"])
def test_accounting_and_limits(overflow):
    ids, valid, scores = _case(99, 200, 8, 2, skew=10.0, pad=0.2)
    cap = expert_capacity(1.0, int(valid.sum()), 2, 8)
    r = apply_capacity(ids, valid, scores, cap, overflow)
    computed = int((r.assigned >= 0).sum())
    # Every routed pair is computed (kept or moved) or dropped, exactly once.
    assert int(r.routed.sum()) == int(valid.sum()) * 2 == computed + int(r.dropped.sum())
    kept = torch.where(r.assigned == ids, 1, 0)[valid].sum(dim=0)
    assert int(kept.sum()) + int(r.rerouted.sum()) == computed
    assert torch.all(r.dropped <= r.routed) and torch.all(r.rerouted + r.dropped <= r.routed)
    load = torch.bincount(r.assigned[r.assigned >= 0], minlength=8)
    assert int(load.max()) <= cap
    assert torch.all(r.assigned[~valid] == -1)  # padding never routed
    for t in range(ids.shape[0]):  # a token never computes twice at the same expert
        chosen = [e for e in r.assigned[t].tolist() if e >= 0]
        assert len(chosen) == len(set(chosen))
    if overflow == "drop":
        assert int(r.rerouted.sum()) == 0 and int(r.dropped.sum()) > 0
    else:
        assert int(r.rerouted.sum()) > 0
        # A pair is dropped only when every expert the token could still use is full.
        for t, j in torch.nonzero((r.assigned == -1) & valid[:, None]).tolist():
            free = [e for e in range(8) if e not in ids[t].tolist() and e not in r.assigned[t].tolist()]
            assert all(int(load[e]) == cap for e in free)


def test_dropless_keeps_everything_but_padding():
    ids, valid, scores = _case(3, 50, 6, 2, skew=20.0, pad=0.3)
    r = apply_capacity(ids, valid, scores, None, "drop")
    assert torch.equal(r.assigned[valid], ids[valid])
    assert int(r.dropped.sum()) == int(r.rerouted.sum()) == 0
    assert int(r.routed.sum()) == 2 * int(valid.sum())
