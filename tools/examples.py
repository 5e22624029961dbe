"""Example windows, one per verdict, simulated from a routing and timing model (numpy only).

Each scenario routes tokens (top-k over a per-layer expert distribution), applies the capacity
factor before dispatch, picks replicas the runtime's way (a replica on the token's own rank first,
else spread evenly), and times each step with a simple EP model in which every rank starts the layer
together and the combine all-to-all ends when the slowest rank's compute does, so fast ranks wait
inside the collective (the effect the triage order exists to see through).

Windows with absent evidence (PARTIAL_EXAMPLES) are the same simulations with measured fields left
out, as a source that sees only logical counts sends them (docs/telemetry.md, "Absent evidence").

`write_examples(folder, seed=EXAMPLE_SEED)` is what produced examples/*.json.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from moewatch import telemetry as tm
from moewatch.telemetry import OPTIONAL_ARRAYS, Window

EXAMPLE_SEED = 20261130


@dataclass(frozen=True)
class Scenario:
    """Knobs of one simulated EP group. Times in seconds, bandwidth in bytes/s."""

    name: str
    intended_verdict: str
    intended_cause: str | None
    intended_overflow: bool
    world_size: int = 4
    num_layers: int = 4
    num_experts: int = 16
    extra_slots: int = 0  # replicas beyond one slot per expert (slot budget P - E)
    top_k: int = 2
    tokens_per_step: int = 4096
    steps: int = 8
    hidden_bytes: int = 8192  # hidden 4096 x bf16
    zipf: float = 0.0  # exponent of expert popularity (0 = uniform)
    hot_experts: tuple[int, ...] = ()  # experts given `hot_weight` x the popularity of the others
    hot_weight: float = 1.0
    home_bias: float = 0.0  # share of a token's picks forced onto experts of the next rank (bad mapping)
    capacity_factor: float = 0.0
    link_bandwidth: float = 4.5e11
    message_latency: float = 2e-5  # fixed cost of one all-to-all
    seconds_per_pair: float = 7e-7  # expert compute per pair (SwiGLU 4096 x 14336 at ~500 TFLOP/s)
    router_seconds: float = 5e-5
    slow_rank_factor: float = 1.0  # rank 0's compute slowed by this (a hardware straggler)
    jitter: float = 0.03


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("healthy", "healthy", None, False),
    Scenario("comm-bound-volume", "comm-bound", "volume", False, link_bandwidth=1.2e10),
    Scenario("comm-bound-small-batch", "comm-bound", "small-batch", False, tokens_per_step=16,
             message_latency=6e-5, seconds_per_pair=2e-6),
    Scenario("comm-bound-placement", "comm-bound", "placement", False, link_bandwidth=1.2e10, home_bias=0.9),
    Scenario("imbalance-hot-experts", "imbalance-bound", "hot-experts", False,
             hot_experts=(1, 2, 3), hot_weight=8.0),
    Scenario("imbalance-straggler", "imbalance-bound", "straggler", False, slow_rank_factor=1.8),
    Scenario("overflow", "healthy", None, True, zipf=0.5, capacity_factor=1.25),
]}


def _placement(s: Scenario) -> np.ndarray:
    """[L, P] contiguous placement; extra slots replicate the first experts."""
    base = np.arange(s.num_experts)
    pmap = np.concatenate([base, base[: s.extra_slots]])
    return np.tile(pmap, (s.num_layers, 1))


def _popularity(s: Scenario, layer: int, rng: np.random.Generator) -> np.ndarray:
    ranks = np.arange(1, s.num_experts + 1, dtype=np.float64)
    weights = ranks ** (-s.zipf) if s.zipf else np.ones(s.num_experts)
    weights = weights[rng.permutation(s.num_experts)] if s.zipf else weights
    for e in s.hot_experts:
        weights[e] *= s.hot_weight
    return weights / weights.sum()


def _route_step(s: Scenario, popularity: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[W, E] pairs from each rank's tokens to each logical expert for one step (top-k distinct)."""
    W, E = s.world_size, s.num_experts
    per_expert_rank = E // W
    tokens_per_rank = np.bincount(np.arange(s.tokens_per_step) % W, minlength=W)
    counts = np.zeros((W, E), dtype=np.int64)
    for r in range(W):
        n = int(tokens_per_rank[r])
        if n == 0:
            continue
        probs = popularity.copy()
        if s.home_bias:
            away = np.zeros(E, dtype=bool)
            nxt = (r + 1) % W
            away[nxt * per_expert_rank:(nxt + 1) * per_expert_rank] = True
            probs = (1 - s.home_bias) * probs + s.home_bias * away / away.sum()
        # top-k distinct experts per token: Gumbel top-k sampling over log-probabilities.
        keys = np.log(probs)[None, :] + rng.gumbel(size=(n, E))
        picks = np.argpartition(-keys, s.top_k - 1, axis=1)[:, : s.top_k]
        counts[r] = np.bincount(picks.ravel(), minlength=E)
    return counts


def _apply_capacity(s: Scenario, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop pairs over ceil(C * N * k / E) per expert (taking from the most loaded ranks first)."""
    dropped = np.zeros(s.num_experts, dtype=np.int64)
    if s.capacity_factor <= 0:
        return counts, dropped
    cap = math.ceil(s.capacity_factor * s.tokens_per_step * s.top_k / s.num_experts)
    counts = counts.copy()
    for e in np.flatnonzero(counts.sum(axis=0) > cap):
        excess = int(counts[:, e].sum() - cap)
        dropped[e] = excess
        for r in np.argsort(-counts[:, e], kind="stable"):
            take = min(excess, int(counts[r, e]))
            counts[r, e] -= take
            excess -= take
            if excess == 0:
                break
    return counts, dropped


def _to_slots(pmap_row: np.ndarray, counts: np.ndarray, world_size: int) -> np.ndarray:
    """[W, P] pairs from each rank to each slot: a local replica first, else spread evenly."""
    W, P = world_size, len(pmap_row)
    slot_rank = np.arange(P) // (P // W)
    out = np.zeros((W, P), dtype=np.int64)
    for e in range(counts.shape[1]):
        slots = np.flatnonzero(pmap_row == e)
        for r in range(W):
            n = int(counts[r, e])
            if n == 0:
                continue
            local = slots[slot_rank[slots] == r]
            targets = local if len(local) else slots
            share, rest = divmod(n, len(targets))
            out[r, targets] += share
            out[r, targets[:rest]] += 1
    return out


def simulate(s: Scenario, seed: int = EXAMPLE_SEED, start_time: float | None = None) -> Window:
    """One window of the scenario. Deterministic for a given seed."""
    rng = np.random.default_rng(seed)
    L, E, W = s.num_layers, s.num_experts, s.world_size
    pmap = _placement(s)
    P = pmap.shape[1]
    if P % W:
        raise ValueError(f"{P} slots do not divide over {W} ranks")
    shape_lw = (L, W)
    z = dict(expert=np.zeros((L, E), np.int64), slot=np.zeros((L, P), np.int64),
             dropped=np.zeros((L, E), np.int64), traffic=np.zeros((L, W, W), np.int64))
    times = {k: np.zeros(shape_lw) for k in ("dispatch", "combine", "compute", "layer")}
    step_seconds = np.zeros(s.steps)
    slowdown = np.ones(W)
    slowdown[0] = s.slow_rank_factor
    popularity = [_popularity(s, layer, rng) for layer in range(L)]
    for step in range(s.steps):
        for layer in range(L):
            routed = _route_step(s, popularity[layer], rng)
            kept, dropped = _apply_capacity(s, routed)
            to_slot = _to_slots(pmap[layer], kept, W)
            traffic = to_slot.reshape(W, W, P // W).sum(axis=2)
            z["expert"][layer] += routed.sum(axis=0)
            z["dropped"][layer] += dropped
            z["slot"][layer] += to_slot.sum(axis=0)
            z["traffic"][layer] += traffic

            noise = 1 + s.jitter * rng.standard_normal(W).clip(-2, 2)
            cross = traffic - np.diag(np.diag(traffic))
            busiest_bytes = max(cross.sum(axis=1).max(), cross.sum(axis=0).max()) * s.hidden_bytes
            transfer = s.message_latency + busiest_bytes / s.link_bandwidth
            compute = traffic.sum(axis=0) * s.seconds_per_pair * slowdown * noise
            # Everyone leaves dispatch together; combine ends when the slowest compute has been sent.
            finish = compute.max() + transfer
            dispatch = np.full(W, transfer)
            combine = finish - compute
            times["dispatch"][layer] += dispatch
            times["compute"][layer] += compute
            times["combine"][layer] += combine
            times["layer"][layer] += s.router_seconds + dispatch + compute + combine
        step_seconds[step] = times["layer"].max(axis=1).sum() / (step + 1)
    traffic = z["traffic"]
    local = np.diagonal(traffic, axis1=1, axis2=2).copy()
    start = time.time() if start_time is None else start_time
    total = float(times["layer"].max(axis=1).sum())
    per_step = np.full(s.steps, total / s.steps) * (1 + s.jitter * rng.standard_normal(s.steps).clip(-2, 2))
    return Window(
        runtime="moewatch-examples", model=f"example-{s.name}", ep_group="example", world_size=W,
        ranks_per_node=W, num_layers=L, num_experts=E, num_slots=P, top_k=s.top_k, epoch=0, steps=s.steps,
        start_time=start, end_time=start + total, hidden_bytes=s.hidden_bytes,
        physical_to_logical_map=pmap, expert_tokens=z["expert"], slot_tokens=z["slot"],
        dropped_tokens=z["dropped"], rerouted_tokens=np.zeros((L, E), np.int64),
        capacity_factor=np.full(L, s.capacity_factor), local_tokens=local,
        sent_tokens=traffic.sum(axis=2) - local, received_tokens=traffic.sum(axis=1) - local, traffic=traffic,
        dispatch_seconds=times["dispatch"], combine_seconds=times["combine"], compute_seconds=times["compute"],
        layer_seconds=times["layer"], step_seconds=np.abs(per_step),
        step_tokens=np.full(s.steps, s.tokens_per_step),
        extra={"example": {"scenario": s.name, "seed": seed, "intended_verdict": s.intended_verdict,
                           "intended_cause": s.intended_cause, "intended_overflow": s.intended_overflow}},
    )


# name -> (scenario simulated, fields left out, intended (verdict, cause, overflow)). "logical-only":
# what an engine that counts routed pairs per logical expert and nothing else sends; its overflow
# is unknown, so the flag is False and the layers list `capacity` as missing.
PARTIAL_EXAMPLES: dict[str, tuple[str, tuple[str, ...], tuple[str, str | None, bool]]] = {
    "logical-only-hot-experts": ("imbalance-hot-experts", tuple(sorted(OPTIONAL_ARRAYS)),
                                 ("imbalance-bound", "hot-experts", False)),
    # What SGLang's /metrics heatmap sees: per-rank totals only (rank_tokens), nothing per expert.
    "rank-totals-imbalance": ("imbalance-hot-experts",
                              tuple(sorted((OPTIONAL_ARRAYS - {"rank_tokens"}) | {"expert_tokens"})),
                              ("imbalance-bound", None, False)),
}


def without_evidence(w: Window, fields) -> Window:
    """The window with `fields` left out (absent evidence), marked in `extra.example.absent`. Without
    expert_tokens it is what a source of per-rank totals sends: the ranks' computed pairs become
    rank_tokens, and the per-expert capacity counts go too."""
    extra = dict(w.extra)
    changes = {name: None for name in fields}
    if "expert_tokens" in fields:
        changes.update(rank_tokens=tm.rank_load(w), dropped_tokens=None, rerouted_tokens=None)
    if {"dispatch_seconds", "combine_seconds"} & set(fields):
        # A wait is part of the all-to-all time, and the time over the bound is made of it: they go with it.
        changes.update(wait_seconds=None, a2a_bound_seconds=None, a2a_over_bound=None)
    if "example" in extra:
        extra["example"] = {**extra["example"], "absent": sorted(n for n, v in changes.items() if v is None)}
    return w.replace(extra=extra, **changes)


def partial_example(name: str, seed: int = EXAMPLE_SEED, start_time: float | None = None) -> Window:
    base, fields, (verdict, cause, overflow) = PARTIAL_EXAMPLES[name]
    w = simulate(SCENARIOS[base], seed=seed, start_time=start_time)
    w = without_evidence(w, fields)
    intended = {"intended_verdict": verdict, "intended_cause": cause, "intended_overflow": overflow}
    return w.replace(model=f"example-{name}", extra={**w.extra, "example": {**w.extra["example"], **intended}})


def write_examples(folder: str | Path, seed: int = EXAMPLE_SEED) -> list[Path]:
    """Write one window per scenario (and per partial example) as `<name>.json` into folder; returns
    the paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    windows = [(scenario.name, simulate(scenario, seed=seed + i, start_time=1_790_000_000.0))
               for i, scenario in enumerate(SCENARIOS.values())]
    windows += [(name, partial_example(name, seed=seed + len(SCENARIOS) + i, start_time=1_790_000_000.0))
                for i, name in enumerate(PARTIAL_EXAMPLES)]
    for name, window in windows:
        path = folder / f"{name}.json"
        path.write_text(window.to_json(indent=1) + "\n")
        paths.append(path)
    return paths


def scenario(name: str, **changes) -> Scenario:
    """A named scenario with some knobs changed (for tests and demos)."""
    return replace(SCENARIOS[name], **changes)


def production_window(seed: int = 0, *, num_layers: int = 58, num_experts: int = 256, num_slots: int = 320,
                      world_size: int = 64, top_k: int = 8, tokens_per_step: int = 4096, steps: int = 10,
                      hidden_bytes: int = 14336, start_time: float = 1_790_000_000.0, model: str = "bench",
                      ep_group: str = "bench", routing_sigma: float | None = None) -> Window:
    """One window at production size, built with array operations only (the scenarios' per-token
    simulation is too slow at 58 x 256): a few hot experts per layer (tools/synthetic.py's "hot"
    popularity), or with `routing_sigma` near-uniform routing (each expert's share exp(N(0, sigma)),
    no hot experts), the extra slots replicating the hottest experts, each slot's pairs coming evenly
    from every rank, times from a simple per-pair and per-byte model (every rank at the same speed
    per pair, 2 % noise). For benchmarks at scale and the triage's healthy-rank tests."""
    from .synthetic import popularity, sample_load

    rng = np.random.default_rng(seed)
    L, E, P, W = num_layers, num_experts, num_slots, world_size
    spr = P // W
    if routing_sigma is None:
        shares = popularity("hot", L, E, rng)
    else:
        shares = rng.lognormal(0.0, routing_sigma, size=(L, E))
        shares /= shares.sum(axis=1, keepdims=True)
    load = sample_load(shares, tokens_per_step * top_k * steps, rng)  # [L, E]
    hottest = np.argsort(-load, axis=1, kind="stable")[:, :P - E]
    pmap = np.concatenate([np.tile(np.arange(E), (L, 1)), hottest], axis=1)
    pmap = np.take_along_axis(pmap, np.argsort(rng.random((L, P)), axis=1), axis=1)  # scatter over ranks
    replicas = np.zeros((L, E), np.int64)
    np.add.at(replicas, (np.repeat(np.arange(L), P), pmap.ravel()), 1)
    # An expert's pairs split evenly over its slots, remainders to its first slots.
    per_slot = np.take_along_axis(load // replicas, pmap, axis=1)
    order = np.argsort(pmap, axis=1, kind="stable")
    nth = np.zeros((L, P), np.int64)  # each slot's position among its expert's slots
    sorted_pmap = np.take_along_axis(pmap, order, axis=1)
    starts = np.concatenate([np.ones((L, 1), bool), sorted_pmap[:, 1:] != sorted_pmap[:, :-1]], axis=1)
    idx = np.arange(P)[None, :].repeat(L, 0)
    group_start = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
    np.put_along_axis(nth, order, idx - group_start, axis=1)
    rem = np.take_along_axis(load % replicas, pmap, axis=1)
    slot_tokens = per_slot + (nth < rem)
    # Each slot's pairs come evenly from every rank (remainders to the first ranks).
    origin = slot_tokens[:, :, None] // W + (np.arange(W)[None, None, :] < (slot_tokens % W)[:, :, None])
    traffic = origin.reshape(L, W, spr, W).sum(axis=2).transpose(0, 2, 1)  # [L, from, to]
    local = np.diagonal(traffic, axis1=1, axis2=2).copy()
    sent = traffic.sum(axis=2) - local
    received = traffic.sum(axis=1) - local
    rank_load = local + received
    compute = rank_load * 2e-7 * (1 + 0.02 * rng.standard_normal((L, W)).clip(-2, 2))
    transfer = np.maximum(sent, received).max(axis=1, keepdims=True) * hidden_bytes / 4.5e11 + 2e-5 * steps
    dispatch = np.repeat(transfer, W, axis=1)
    combine = compute.max(axis=1, keepdims=True) + transfer - compute
    layer_seconds = dispatch + compute + combine + 5e-5 * steps
    step = float(layer_seconds.max(axis=1).sum()) / steps
    return Window(
        runtime="moewatch-examples", model=model, ep_group=ep_group, world_size=W, ranks_per_node=8,
        num_layers=L, num_experts=E, num_slots=P, top_k=top_k, epoch=0, steps=steps, start_time=start_time,
        end_time=start_time + step * steps, hidden_bytes=hidden_bytes, physical_to_logical_map=pmap,
        expert_tokens=load, slot_tokens=slot_tokens, dropped_tokens=np.zeros((L, E), np.int64),
        rerouted_tokens=np.zeros((L, E), np.int64), capacity_factor=np.zeros(L), local_tokens=local,
        sent_tokens=sent, received_tokens=received, traffic=traffic, dispatch_seconds=dispatch,
        combine_seconds=combine, compute_seconds=compute, layer_seconds=layer_seconds,
        # What a source that counts its waits reports: the combine's wait for the slowest compute.
        wait_seconds=compute.max(axis=1, keepdims=True) - compute,
        step_seconds=np.full(steps, step) * (1 + 0.02 * rng.standard_normal(steps).clip(-2, 2)),
        step_tokens=np.full(steps, tokens_per_step))
