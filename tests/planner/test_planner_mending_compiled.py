"""The mending's loops compiled with numba (mending_compiled.py) give the numpy loops' placements bit
for bit: every rank of an engine must decide alike, with or without numba."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moewatch.planner import incremental, mending_compiled
from moewatch.planner.placement_math import contiguous_placement
from moewatch.planner.rebalance import RebalanceSettings, gated_rebalance
from moewatch.tools.synthetic import drifted, popularity, sample_load


def _repair_both(monkeypatch, load, start, gpus, tolerance, nodes=1, max_moves=None):
    """(numpy's Repair, the compiled one's) for the same inputs."""
    monkeypatch.setenv(mending_compiled.SWITCH, "0")
    plain = incremental.repair_placement(load, start, gpus, tolerance, nodes, max_moves)
    monkeypatch.delenv(mending_compiled.SWITCH)
    assert mending_compiled.kernel() is not None
    compiled = incremental.repair_placement(load, start, gpus, tolerance, nodes, max_moves)
    return plain, compiled


def _assert_same(plain, compiled):
    for name in ("physical_to_logical_map", "target_max", "busiest", "reached", "count_changes", "swaps"):
        np.testing.assert_array_equal(getattr(compiled, name), getattr(plain, name), err_msg=name)


def test_numba_is_installed_and_the_loops_compile(monkeypatch):
    monkeypatch.delenv(mending_compiled.SWITCH, raising=False)
    compiled = mending_compiled.kernel()
    assert compiled is not None, (f"{mending_compiled.unavailable_reason()}: the suite needs the `fast` extra "
                                  "(pip install -e '.[dev]')")
    assert mending_compiled.warm_up().startswith("the mending runs compiled")


def test_switched_off_the_numpy_loops_run(monkeypatch):
    monkeypatch.setenv(mending_compiled.SWITCH, "off")
    assert mending_compiled.kernel() is None
    assert "MOEWATCH_PLANNER_COMPILED" in mending_compiled.unavailable_reason()
    assert "numpy" in mending_compiled.warm_up()


def test_a_process_that_compiles_only_when_asked_runs_numpys_loops_until_the_switch_is_on(monkeypatch):
    monkeypatch.setattr(mending_compiled, "_default_on", True)
    monkeypatch.delenv(mending_compiled.SWITCH, raising=False)
    assert mending_compiled.wanted()
    mending_compiled.compile_only_when_asked()
    assert not mending_compiled.wanted() and mending_compiled.kernel() is None
    assert "is not set on" in mending_compiled.unavailable_reason()
    monkeypatch.setenv(mending_compiled.SWITCH, "1")
    assert mending_compiled.wanted() and mending_compiled.kernel() is not None


@pytest.mark.parametrize("length", [*range(0, 40), 63, 64, 127, 128, 129, 130, 255, 256, 257, 300, 1000, 1027])
def test_a_row_is_summed_in_numpys_order(monkeypatch, length):
    monkeypatch.delenv(mending_compiled.SWITCH, raising=False)
    rng = np.random.default_rng(length)
    # magnitudes over ten orders, so that any other order of adding shows in the last bits
    rows = rng.random((6, length)) * 10.0 ** rng.uniform(-5, 5, (6, length))
    from moewatch.planner import _mending_kernels  # numba's; the test above fails first without it

    numpy_sum = _mending_kernels.numpy_sum
    for row in rows:
        assert numpy_sum(row) == row.sum()
    # and the GPU loads as the mending sums them: a reduction over the last axis of [A, W, S]
    grid = rows.reshape(2, 3, length)
    assert [[numpy_sum(r) for r in layer] for layer in grid] == grid.sum(axis=2).tolist()


@pytest.mark.parametrize("kind", ["lognormal", "zipf", "hot"])
@pytest.mark.parametrize("gpus, slots_per_gpu, nodes", [(4, 3, 1), (8, 5, 2), (16, 2, 4), (16, 9, 2), (64, 5, 8)])
def test_the_compiled_mending_is_the_numpy_mending(monkeypatch, kind, gpus, slots_per_gpu, nodes):
    rng = np.random.default_rng(gpus * 31 + slots_per_gpu)
    L = 6
    P = gpus * slots_per_gpu
    E = max(2, P - gpus)  # a redundant slot per GPU
    probabilities = popularity(kind, L, E, rng)
    load = sample_load(probabilities, 100_000, rng).astype(float)
    start = contiguous_placement(L, E, P).astype(np.int64)
    for tolerance in (0.002, 0.01, 0.05):
        plain, compiled = _repair_both(monkeypatch, load, start, gpus, tolerance, nodes)
        _assert_same(plain, compiled)
        assert compiled.swaps.sum() + compiled.count_changes.sum() > 0  # the loops had work to do
        # from the mended placement under a drifted load (the engines' later calls)
        later = sample_load(drifted(probabilities, rng), 100_000, rng).astype(float)
        plain, compiled = _repair_both(monkeypatch, later, plain.physical_to_logical_map, gpus, tolerance, nodes)
        _assert_same(plain, compiled)
    plain, compiled = _repair_both(monkeypatch, load, start, gpus, 0.01, nodes, max_moves=3)
    _assert_same(plain, compiled)
    assert (compiled.swaps + compiled.count_changes).max() <= 3


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_layers_split_over_threads_mend_as_one_call(monkeypatch, threads):
    # mending_compiled.over_layers: each thread mends a run of consecutive layers of the same arrays
    # (7 layers: runs of unequal length); numpy's loops, one call over all layers, are the reference.
    rng = np.random.default_rng(threads)
    L, gpus, P = 7, 16, 80
    load = sample_load(popularity("zipf", L, 64, rng), 200_000, rng).astype(float)
    start = contiguous_placement(L, 64, P).astype(np.int64)
    monkeypatch.setattr(mending_compiled, "_THREADS", threads)
    monkeypatch.setattr(mending_compiled, "_pool", None)
    plain, compiled = _repair_both(monkeypatch, load, start, gpus, 0.005, nodes=2)
    _assert_same(plain, compiled)
    assert (compiled.swaps > 0).sum() >= 4  # most layers had swaps to make, in every run


@settings(max_examples=60, deadline=None)
@given(data=st.data(), gpus=st.sampled_from([2, 3, 4, 8]), slots_per_gpu=st.integers(1, 4),
       tolerance=st.sampled_from([0.0, 0.01, 0.1]))
def test_ties_go_the_same_way(data, gpus, slots_per_gpu, tolerance):
    # Small integer loads: many equal GPU loads, swaps and replicas, so every first-maximum rule and
    # every stable order is put to the test.
    P = gpus * slots_per_gpu
    E = data.draw(st.integers(1, P))
    L = 3
    load = np.array(data.draw(st.lists(st.lists(st.integers(0, 6), min_size=E, max_size=E), min_size=L,
                                       max_size=L)), dtype=float)
    start = contiguous_placement(L, E, P).astype(np.int64)
    with pytest.MonkeyPatch.context() as patch:
        plain, compiled = _repair_both(patch, load, start, gpus, tolerance, nodes=1 if gpus % 2 else 2)
    _assert_same(plain, compiled)


def test_the_engine_rebalances_are_the_same_at_the_benchmarks_shape(monkeypatch):
    # 61 x 256 experts, 320 slots, 64 GPUs on 8 nodes: the EPLB benchmark's shape, three drifting
    # windows, each from the placement the last one left.
    rng = np.random.default_rng(7)
    probabilities = popularity("lognormal", 61, 256, rng)
    settings_ = RebalanceSettings(window_steps=1000.0)
    maps = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(mending_compiled.SWITCH, mode)
        window_rng = np.random.default_rng(8)
        drifting = probabilities
        current = contiguous_placement(61, 256, 320).astype(np.int64)
        out = []
        for _ in range(3):
            load = sample_load(drifting, 1000 * 131072, window_rng)
            current = gated_rebalance(load, 320, 64, 8, current, settings_).physical_to_logical_map
            out.append(current)
            drifting = drifted(drifting, window_rng)
        maps[mode] = np.stack(out)
    np.testing.assert_array_equal(maps["1"], maps["0"])
    assert (maps["1"][1] != maps["1"][0]).any()  # the later windows moved something


def _pack_both(monkeypatch, fn):
    monkeypatch.setenv(mending_compiled.SWITCH, "0")
    plain = fn()
    monkeypatch.delenv(mending_compiled.SWITCH)
    assert mending_compiled.kernel() is not None
    return plain, fn()


@pytest.mark.parametrize("seed", range(40))
def test_the_packings_compiled_loops_give_numpys_placements(monkeypatch, seed):
    # lpt_pack's greedy and refine_by_swaps' paired and single rounds, with one node and several,
    # ties in the loads, GPUs beyond and within the idlest eight, and the movement planner's options.
    from moewatch.planner.packing import lpt_pack, pack, refine_by_swaps
    from moewatch.planner.replicate import replica_counts

    rng = np.random.default_rng(seed)
    layers, experts = int(rng.integers(1, 7)), int(rng.choice([4, 8, 16, 32]))
    gpus = int(rng.choice([2, 3, 4, 8, 16]))
    nodes = int(rng.choice([n for n in (1, 2, 4) if gpus % n == 0]))
    slots = (-(-experts // gpus) + int(rng.integers(0, 3))) * gpus
    load = sample_load(popularity(str(rng.choice(["lognormal", "zipf", "hot"])), layers, experts, rng),
                       int(rng.choice([40, 3000])), rng).astype(np.float64)
    if seed % 4 == 0:
        load = np.round(load / 10.0) * 10.0  # equal loads: ties broken alike
    counts = replica_counts(load, slots)
    start = lpt_pack(load, counts, gpus, nodes)
    for fn in (lambda: lpt_pack(load, counts, gpus, nodes), lambda: pack(load, counts, gpus, nodes),
               lambda: refine_by_swaps(load, start, gpus, nodes, pairs=False),
               lambda: refine_by_swaps(load, start, gpus, nodes, layers=np.arange(0, layers, 2),
                                       target_max=load.sum(axis=1) / gpus * 1.05)):
        plain, compiled = _pack_both(monkeypatch, fn)
        np.testing.assert_array_equal(compiled, plain)
