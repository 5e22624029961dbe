"""The triage's vectorised estimates equal the one-layer loops they replaced, number for number.

The loops below are the reference: the triage's predicted gains as they were computed before the
per-window cost work (one greedy packing per layer and action, in Python). The vectorised versions
must give the same floats, so the diagnoses (and everything the agent does with them) are unchanged.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from moewatch.capacity import mean_load_capacities, mean_load_overflow_rates
from moewatch.tools.examples import SCENARIOS, production_window, scenario, simulate, without_evidence
from moewatch.thresholds import Thresholds
from moewatch.triage import IMBALANCE_BOUND, diagnose, pack_max_loads, replica_splits


# --- the reference: the loops, as they were ---------------------------------------------------

def ref_pack_max_load(item_loads, num_ranks, slots_per_rank):
    loads = np.zeros(num_ranks)
    free = np.full(num_ranks, slots_per_rank)
    for item in np.sort(np.asarray(item_loads, dtype=np.float64))[::-1]:
        open_ranks = np.flatnonzero(free > 0)
        target = open_ranks[np.argmin(loads[open_ranks])]
        loads[target] += item
        free[target] -= 1
    return float(loads.max())


def ref_replica_split(expert_load, experts, extra_slots):
    expert_load = np.asarray(expert_load, dtype=np.float64)
    replicas = {e: 1 for e in experts}
    for _ in range(extra_slots):
        e = max(experts, key=lambda x: expert_load[x] / replicas[x])
        replicas[e] += 1
    parts = [np.full(replicas.get(e, 1), expert_load[e] / replicas.get(e, 1)) for e in range(len(expert_load))]
    return np.concatenate(parts)


def ref_capacity_for_overflow(expert_load, target):
    load = np.sort(np.asarray(expert_load, dtype=np.float64))[::-1]
    total, mean = load.sum(), load.mean()
    if total <= 0:
        return 0.0
    budget = target * total
    for n_over in range(1, len(load) + 1):
        next_level = load[n_over] if n_over < len(load) else 0.0
        overflow_at_next = float((load[:n_over] - next_level).sum())
        if overflow_at_next > budget or n_over == len(load):
            cap = (load[:n_over].sum() - budget) / n_over
            return float(max(cap, 0.0) / mean)
    return float(load[0] / mean)


def ref_overflow_at_capacity(expert_load, capacity_factor):
    load = np.asarray(expert_load, dtype=np.float64)
    total = load.sum()
    if total <= 0 or capacity_factor <= 0:
        return 0.0
    return float(np.maximum(load - capacity_factor * load.mean(), 0.0).sum() / total)


def ref_round_up(c):
    return math.ceil(c * 100 - 1e-9) / 100


def ref_gains(w, d, t):
    """(kind, predicted_gain, params) of the packing-based actions of one diagnosed layer, the old way."""
    layer, m = d.layer, d.metrics
    W, spr = w.world_size, w.slots_per_rank
    expert_load = (w.expert_tokens[layer] - w.dropped_tokens[layer]).astype(np.float64)
    now_max = float(max(np.max(m["rank_load"]), 1))
    out = {}
    if d.verdict == IMBALANCE_BOUND or d.cause == "volume":
        hot = m["hot_experts"] or [int(e) for e in np.argsort(-expert_load, kind="stable")[:max(1, W // 2)]]
        extra = max(len(hot), W // 2)
        after = ref_pack_max_load(ref_replica_split(expert_load, hot, extra), W, spr + math.ceil(extra / W))
        gain = max(0.0, 1.0 - after / now_max)
        if d.cause == "volume":
            gain = max(gain, m["a2a_share"] * min(1.0, extra / max(w.num_slots, 1)))
        out["replicate"] = (gain, {"experts": hot, "extra_slots": extra})
    if d.verdict == IMBALANCE_BOUND or d.cause == "placement":
        after = ref_pack_max_load(w.slot_tokens[layer].astype(np.float64), W, spr)
        out["placement"] = max(0.0, 1.0 - after / now_max)  # before the straggler / mapping terms
    if not d.overflow and d.verdict == IMBALANCE_BOUND and d.cause == "hot-experts":
        value = ref_round_up(ref_capacity_for_overflow(w.expert_tokens[layer], t.overflow_target))
        if value > 0:
            capped = np.minimum(w.expert_tokens[layer], value * w.expert_tokens[layer].mean())
            gain = max(0.0, 1.0 - ref_pack_max_load(capped, W, spr) / now_max)
            drop = ref_overflow_at_capacity(w.expert_tokens[layer], value)
            out["capacity"] = (gain, {"value": value, "predicted_overflow": round(drop, 4), "lossy": True})
    return out


# --- the comparisons --------------------------------------------------------------------------

def random_rows(rng, rows, n, kind):
    if kind == "ints":  # many ties
        return rng.integers(0, 6, size=(rows, n)).astype(np.float64)
    if kind == "zeros":
        x = rng.integers(0, 3, size=(rows, n)).astype(np.float64)
        x[:, ::2] = 0
        return x
    return rng.lognormal(0.0, 1.5, size=(rows, n))


def test_batched_packing_equals_the_sequential_greedy_row_by_row():
    rng = np.random.default_rng(11)
    for trial in range(150):
        W, spr = int(rng.integers(1, 9)), int(rng.integers(1, 6))
        n = int(rng.integers(0, W * spr + 1))
        items = random_rows(rng, 6, n, ("ints", "zeros", "real")[trial % 3])
        got = pack_max_loads(items, W, spr)
        assert got.tolist() == [ref_pack_max_load(row, W, spr) for row in items], (trial, W, spr)
    # Rows with their own slot counts in one batch.
    items = random_rows(rng, 4, 12, "real")
    spr = np.array([3, 4, 5, 6])
    assert pack_max_loads(items, 4, spr).tolist() == [ref_pack_max_load(r, 4, s) for r, s in zip(items, spr)]


def test_replica_split_and_capacity_estimates_equal_the_loops():
    rng = np.random.default_rng(12)
    for trial in range(60):
        E = int(rng.integers(2, 40))
        load = rng.integers(0, 1000, size=(5, E)).astype(np.float64)
        if trial % 4 == 0:
            load[:, :3] = 777.0  # ties among the hot experts
        hot = [list(rng.permutation(E)[:int(rng.integers(1, E + 1))]) for _ in range(5)]
        extra = rng.integers(0, 12, size=5)
        padded = np.full((5, E), -1)
        for i, h in enumerate(hot):
            padded[i, :len(h)] = h
        split, used = replica_splits(load, padded, extra)
        for i in range(5):
            ref = ref_replica_split(load[i], hot[i], int(extra[i]))
            assert used[i] == len(ref) and np.array_equal(np.sort(split[i, :used[i]]), np.sort(ref))
            assert not split[i, used[i]:].any()
        target = float(rng.choice([0.0, 0.01, 0.05, 0.3]))
        caps = mean_load_capacities(load, target)
        assert caps.tolist() == [ref_capacity_for_overflow(row, target) for row in load]
        assert (mean_load_overflow_rates(load, caps).tolist()
                == [ref_overflow_at_capacity(r, c) for r, c in zip(load, caps)])
    assert mean_load_capacities(np.zeros((2, 4)), 0.01).tolist() == [0.0, 0.0]


def random_windows():
    rng = np.random.default_rng(13)
    for i in range(6):
        name = list(SCENARIOS)[i % len(SCENARIOS)]
        yield simulate(scenario(name, extra_slots=int(rng.choice([0, 4]))), seed=int(rng.integers(1 << 16)))
    for seed in range(3):
        yield production_window(seed, num_layers=6, num_experts=64, num_slots=80, world_size=16, steps=2)


@pytest.mark.parametrize("index", range(9))
def test_diagnoses_of_random_windows_carry_the_old_predicted_gains(index):
    w = list(random_windows())[index]
    t = Thresholds()
    result = diagnose(w, t)
    checked = 0
    for d in result.layers:
        ref = ref_gains(w, d, t)
        by_kind = {a.kind: a for a in d.actions}
        for kind, value in ref.items():
            if kind == "placement":
                if kind in by_kind and d.cause not in ("straggler", "placement"):
                    assert by_kind[kind].predicted_gain == value
                continue
            gain, params = value
            if gain >= 0.01:
                assert by_kind[kind].predicted_gain == gain, (kind, d.layer)
                assert {k: by_kind[kind].params[k] for k in params} == params
                checked += 1
            else:
                assert kind not in by_kind
    assert checked or all(d.verdict == "healthy" or d.cause == "small-batch" for d in result.layers)
    # One layer at a time (diagnose_layer's own batch of one) gives the same diagnosis.
    from moewatch.triage import diagnose_layer, layer_metrics

    metrics = layer_metrics(w, t)
    for d in result.layers:
        alone = diagnose_layer(w, d.layer, metrics[d.layer], t)
        assert [a.to_dict() for a in alone.actions] == [a.to_dict() for a in d.actions]


def test_production_size_predictions_equal_the_loops():
    w = production_window(3)
    t = Thresholds()
    result = diagnose(w, t)
    assert {d.verdict for d in result.layers} == {IMBALANCE_BOUND}
    for d in result.layers[:: 7]:
        ref = ref_gains(w, d, t)
        by_kind = {a.kind: a for a in d.actions}
        assert by_kind["replicate"].predicted_gain == ref["replicate"][0]
        assert by_kind["placement"].predicted_gain == ref["placement"]
    # Absent rank load: no packing, gains unknown.
    bare = without_evidence(w, {"slot_tokens", "local_tokens", "sent_tokens", "received_tokens", "traffic"})
    assert all(a.predicted_gain is None for d in diagnose(bare, t).layers for a in d.actions)
