"""Properties over random loads and shapes: plans are valid, replication never hurts, refinement
never hurts, topology spread is kept, the EPLB reference is valid."""

from __future__ import annotations

import heapq

import numpy as np
from hypothesis import example, given, settings, strategies as st

from moewatch.planner import packing, placement_math, replicate, solve_placement
from moewatch.tools import eplb_reference as eplb


@st.composite
def problems(draw, max_layers: int = 3, max_gpus: int = 6, max_experts_per_gpu: int = 5, max_extra_per_gpu: int = 2):
    """(load [L, E], W, P, N): P >= E, W | P, N | W."""
    W = draw(st.integers(1, max_gpus))
    E = draw(st.integers(1, W * max_experts_per_gpu))
    P = -(-E // W) * W + W * draw(st.integers(0, max_extra_per_gpu))
    N = draw(st.sampled_from([n for n in range(1, W + 1) if W % n == 0]))
    L = draw(st.integers(1, max_layers))
    kind = draw(st.sampled_from(["uniform", "skewed", "sparse", "zero"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    if kind == "uniform":
        load = rng.integers(0, 1000, size=(L, E))
    elif kind == "skewed":
        load = np.floor(rng.lognormal(3.0, 2.0, size=(L, E)))
    elif kind == "sparse":
        load = rng.integers(0, 1000, size=(L, E)) * (rng.random((L, E)) < 0.2)
    else:
        load = np.zeros((L, E))
    return load.astype(np.float64), W, P, N


def _greedy_counts(row: np.ndarray, num_slots: int) -> np.ndarray:
    counts = np.ones(row.size, dtype=np.int64)
    heap = [(-float(x), e) for e, x in enumerate(row)]
    heapq.heapify(heap)
    for _ in range(num_slots - row.size):
        _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-row[e] / counts[e], e))
    return counts


def _check_valid(pmap: np.ndarray, L: int, E: int, W: int, P: int) -> None:
    assert pmap.shape == (L, P)
    assert P % W == 0  # every GPU owns exactly P / W consecutive slots
    assert pmap.min() >= 0 and pmap.max() < E
    assert (placement_math.replica_counts_of(pmap, E) >= 1).all()


@settings(max_examples=60, deadline=None)
@given(problems())
def test_replica_counts_match_the_one_at_a_time_greedy(problem):
    load, W, P, _ = problem
    counts = replicate.replica_counts(load, P)
    assert (counts >= 1).all() and (counts.sum(axis=1) == P).all()
    for row, got in zip(load, counts):
        if row.sum() == 0:
            continue
        want = _greedy_counts(row, P)
        # ties may go to different experts; the largest load per replica (the objective) is equal
        assert np.max(row / got) == np.max(row / want)


@settings(max_examples=60, deadline=None)
@given(problems())
@example((np.array([[108.0, 643.0, 332.0, 114.0, 194.0, 875.0]]), 5, 15, 1))  # found by CI: 0.903 < 0.933
def test_balanced_plans_are_valid_and_never_worse_than_least_replication(problem):
    load, W, P, N = problem
    L, E = load.shape
    result = solve_placement(load, W, P, N)
    pmap = result.physical_to_logical_map
    _check_valid(pmap, L, E, W, P)
    P0 = -(-E // W) * W
    least = solve_placement(load, W, P0, N).balancedness_after
    if E % W == 0:
        # The property, exact: P0 = E is no replication, whose plan always embeds in P slots.
        assert (result.balancedness_after >= least - 1e-12).all()
    else:
        # W does not divide E: the least plan already replicates and may not embed exactly; the slot
        # search gets within a hair of it (docs/planner.md, "Limits"; 4 in 67,642 random problems
        # fell short, by at most 0.0012).
        assert (result.balancedness_after >= least - 2e-3).all()
    assert (result.balancedness_after > 0).all() and (result.balancedness_after <= 1 + 1e-12).all()


@settings(max_examples=40, deadline=None)
@given(problems())
def test_swaps_never_raise_the_busiest_gpu_and_keep_counts_and_node_spread(problem):
    load, W, P, N = problem
    E = load.shape[1]
    counts = replicate.replica_counts(load, P)
    start = packing.lpt_pack(load, counts, W, N)
    assert (placement_math.replica_counts_of(start, E) == counts).all()
    refined = packing.refine_by_swaps(load, start, W, N)
    assert (placement_math.replica_counts_of(refined, E) == counts).all()
    before = placement_math.gpu_load(load, start, W).max(axis=1)
    after = placement_math.gpu_load(load, refined, W).max(axis=1)
    assert (after <= before * (1 + 1e-12) + 1e-9).all()
    nodes_before = (placement_math.holders(start, E, N) > 0).sum(axis=2)
    nodes_after = (placement_math.holders(refined, E, N) > 0).sum(axis=2)
    assert (nodes_after >= nodes_before).all()
    gpus_dup_before = (placement_math.holders(start, E, W) > 1).sum()
    assert (placement_math.holders(refined, E, W) > 1).sum() <= gpus_dup_before


@settings(max_examples=30, deadline=None)
@given(problems(max_extra_per_gpu=1))
def test_eplb_reference_plans_are_valid(problem):
    load, W, P, N = problem
    L, E = load.shape
    _check_valid(eplb.rebalance_global(load, P, W), L, E, W, P)
    if E % N == 0 and P % N == 0:
        _check_valid(eplb.rebalance_hierarchical(load, P, N, N, W), L, E, W, P)


def test_hierarchical_eplb_keeps_each_expert_on_one_node(rng):
    load = rng.lognormal(0, 1, size=(4, 32))
    pmap = eplb.rebalance_hierarchical(load, 40, 8, 4, 8)
    assert ((placement_math.holders(pmap, 32, 4) > 0).sum(axis=2) == 1).all()


def test_topology_aware_packing_spreads_replicas_over_nodes(rng):
    load = rng.lognormal(0, 1.5, size=(6, 64))
    flat = solve_placement(load, 16, 96, 1).physical_to_logical_map
    aware = solve_placement(load, 16, 96, 4)
    _, flat_node = placement_math.dispatch_cross_shares(load, flat, 16, 4)
    assert aware.cross_node_share_after.mean() < flat_node.mean()
    assert aware.balancedness_after.mean() > 0.99


@settings(max_examples=30, deadline=None)
@given(problems(max_extra_per_gpu=2), st.integers(0, 2**31 - 1))
def test_movement_plans_are_valid_within_tolerance_and_move_no_more_than_renaming(problem, seed):
    load, W, P, N = problem
    L, E = load.shape
    rng = np.random.default_rng(seed)
    in_force = solve_placement(rng.permutation(load, axis=1), W, P, N).physical_to_logical_map
    scratch = solve_placement(load, W, P, N)
    ours = solve_placement(load, W, P, N, current=in_force, tolerance=0.01)
    _check_valid(ours.physical_to_logical_map, L, E, W, P)
    assert (ours.balancedness_after >= scratch.balancedness_after * 0.99 - 1e-12).all()
    from moewatch.planner.movement import align_to_current

    renamed = align_to_current(scratch.physical_to_logical_map, in_force, W, N)
    assert (ours.experts_moved <= placement_math.experts_moved(in_force, renamed)).all()


@settings(max_examples=20, deadline=None)
@given(problems(max_layers=4), st.integers(0, 2**31 - 1), st.floats(0.5, 0.99))
def test_affinity_plans_are_valid_and_keep_the_floor(problem, seed, floor):
    load, W, P, N = problem
    L, E = load.shape
    transitions = np.random.default_rng(seed).integers(0, 5, size=(L - 1, E, E)).astype(float)
    result = solve_placement(load, W, P, N, affinity=transitions, balancedness_floor=floor)
    _check_valid(result.physical_to_logical_map, L, E, W, P)
    balanced = solve_placement(load, W, P, N).balancedness_after
    assert (result.balancedness_after >= np.minimum(floor, balanced) - 1e-12).all()


# Found by a wider random search than these examples: the mending misses layer 1 by more than
# FULL_SOLVE_BELOW, and the full solve's map was not where the next call left it.
_SOLVED_IN_FULL = np.array([[2144792, 748407, 1469938, 5636863], [3940385, 2768913, 2715480, 575222],
                            [6276245, 460537, 1718085, 1545133], [255407, 1286844, 7433340, 1024409]], dtype=np.float64)


@settings(max_examples=60, deadline=None)
@given(problems(max_layers=4), st.floats(1e5, 1e10), st.floats(10.0, 1e4))
@example((_SOLVED_IN_FULL, 2, 6, 2), 2 * 4096 * 14336 * 3, 3000.0)
def test_a_load_that_does_not_change_moves_nothing_after_the_first_gated_rebalance(problem, expert_bytes, horizon):
    from moewatch.planner.rebalance import RebalanceSettings, gated_rebalance

    load, W, P, N = problem
    gate = RebalanceSettings(expert_bytes=expert_bytes, horizon_steps=horizon)
    first = gated_rebalance(load, P, W, N, placement_math.contiguous_placement(*load.shape, P), gate)
    second = gated_rebalance(load, P, W, N, first.physical_to_logical_map, gate)
    assert second.experts_moved.tolist() == [0] * load.shape[0], second.reasons
