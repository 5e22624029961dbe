"""Workloads: Zipf skew, hot experts that drift, inter-layer affinity, trace replay, padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moewatch.runtime.config import ConfigError, RuntimeConfig
from moewatch.runtime.workload import SyntheticRouting, TraceRouting, Workload, padding_mask, popularity


def _counts(routing, step, layer, tokens=4000):
    ids = routing.sample(step, rank=0, num_tokens=tokens)[:, layer]
    return np.bincount(ids.reshape(-1).numpy(), minlength=routing.num_experts)


def test_ids_are_distinct_per_token_and_reproducible():
    routing = SyntheticRouting(3, 16, 4, zipf=1.5, seed=7)
    ids = routing.sample(5, 1, 300)
    assert ids.shape == (300, 3, 4)
    assert torch.all(torch.sort(ids, dim=2).values.diff(dim=2) != 0)
    assert torch.equal(ids, SyntheticRouting(3, 16, 4, zipf=1.5, seed=7).sample(5, 1, 300))
    assert not torch.equal(ids, routing.sample(5, 2, 300))  # another rank, another batch


def test_zipf_exponent_controls_skew():
    flat = _counts(SyntheticRouting(1, 16, 1, zipf=0.0, seed=1), 0, 0)
    skewed = _counts(SyntheticRouting(1, 16, 1, zipf=1.5, seed=1), 0, 0)
    assert flat.max() / flat.mean() < 1.3
    assert skewed.max() / skewed.mean() > 4


def test_hot_experts_carry_their_share_and_drift():
    routing = SyntheticRouting(2, 16, 1, zipf=0.0, hot_experts=2, hot_share=0.6, drift_every=10, seed=3)
    hot = routing.hot_set(0, step=0, count=2)
    counts = _counts(routing, 0, 0)
    assert abs(counts[hot].sum() / counts.sum() - 0.6) < 0.04
    assert routing.hot_set(0, step=9, count=2) == hot
    moved = routing.hot_set(0, step=10, count=2)
    assert not set(moved) & set(hot)  # the whole hot set moved on
    later = _counts(routing, 10, 0)
    assert later[moved].sum() / later.sum() > 0.5
    assert np.isclose(popularity(16, 0.0, 2, 0.6)[:2].sum(), 0.6)


def test_affinity_links_consecutive_layers():
    tied = SyntheticRouting(3, 12, 2, zipf=0.5, affinity=1.0, seed=4)
    ids = tied.sample(0, 0, 200)
    for layer in (1, 2):
        follow = tied.follow[layer][ids[:, layer - 1]]
        assert torch.equal(torch.sort(follow, dim=1).values, torch.sort(ids[:, layer], dim=1).values)
    loose = SyntheticRouting(3, 12, 2, zipf=0.5, affinity=0.0, seed=4).sample(0, 0, 200)
    follow = tied.follow[1][loose[:, 0]]
    assert (torch.sort(follow, 1).values == torch.sort(loose[:, 1], 1).values).all(dim=1).float().mean() < 0.2


def test_padding_mask():
    valid = padding_mask(0, 3, 1, 100, 0.25)
    assert int((~valid).sum()) == 25
    assert torch.equal(valid, padding_mask(0, 3, 1, 100, 0.25))
    assert int(padding_mask(0, 0, 0, 4, 0.99).sum()) == 1  # at least one real token


def test_trace_replay(tmp_path):
    trace = np.arange(10 * 2 * 2).reshape(10, 2, 2) % 7
    trace[:, :, 1] = (trace[:, :, 0] + 1) % 7
    trace[3] = -1  # a padding token
    path = tmp_path / "trace.npy"
    np.save(path, trace)
    cfg = RuntimeConfig(ranks=2, layers=2, experts=7, slots=8, top_k=2, batch_tokens=4, workload="trace",
                        trace=str(path))
    batch = Workload(cfg, rank=0).batch(0)
    assert batch.expert_ids.tolist() == trace[0:4].clip(0).tolist()
    assert batch.valid.tolist() == [True, True, True, False]
    wrapped = Workload(cfg, rank=1).batch(1)  # rows (1 * 2 + 1) * 4 = 12.. -> 2..5 after wrapping
    assert wrapped.expert_ids.tolist() == trace[[2, 3, 4, 5]].clip(0).tolist()


@pytest.mark.parametrize("bad, message", [
    (np.zeros((5, 3, 2), dtype=np.int64), "expected [tokens, 2, 2]"),
    (np.full((5, 2, 2), 9, dtype=np.int64), "below 7"),
    (np.zeros((5, 2, 2), dtype=np.int64), "distinct"),
    (np.zeros((5, 2, 2), dtype=np.float32), "integers"),
])
def test_bad_traces_name_the_field(tmp_path, bad, message):
    path = tmp_path / "bad.npy"
    np.save(path, bad)
    with pytest.raises(ConfigError) as err:
        TraceRouting(str(path), 2, 7, 2, world_size=1)
    assert err.value.field == "trace" and message in str(err.value)
