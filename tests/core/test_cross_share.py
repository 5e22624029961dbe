"""The one-sided cross share the triage uses equals, exactly, its half of dispatch_cross_shares and a
per-expert count of the groups holding it."""

from __future__ import annotations

import numpy as np

from moewatch.planner.placement_math import dispatch_cross_share, dispatch_cross_shares


def reference_cross_share(load, pmap, num_groups):
    L, P = pmap.shape
    per_group = P // num_groups
    out = np.zeros(L)
    for layer in range(L):
        total = load[layer].sum()
        if total <= 0:
            continue
        for expert, pairs in enumerate(load[layer]):
            groups = {slot // per_group for slot in range(P) if pmap[layer, slot] == expert}
            out[layer] += pairs * (1.0 - len(groups) / num_groups)
        out[layer] /= total
    return out


def test_one_side_equals_dispatch_cross_shares_and_the_count():
    rng = np.random.default_rng(7)
    L, E, P, W, N = 5, 12, 16, 8, 2
    pmap = np.concatenate([np.tile(np.arange(E), (L, 1)), rng.integers(0, E, (L, P - E))], axis=1)
    pmap = np.take_along_axis(pmap, np.argsort(rng.random((L, P)), axis=1), axis=1)
    load = rng.integers(0, 500, (L, E)).astype(np.float64)
    load[2] = 0.0  # an idle layer: share 0
    gpu, node = dispatch_cross_shares(load, pmap, W, N)
    assert np.array_equal(dispatch_cross_share(load, pmap, W), gpu)
    assert np.array_equal(dispatch_cross_share(load, pmap, N), node)
    np.testing.assert_allclose(dispatch_cross_share(load, pmap, N), reference_cross_share(load, pmap, N), rtol=1e-12)
    np.testing.assert_allclose(dispatch_cross_share(load, pmap, W), reference_cross_share(load, pmap, W), rtol=1e-12)
