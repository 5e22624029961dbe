"""Cost model: a MoE layer's time from its placement and load, fitted to measured Windows.

Per layer and step (every term a parameter times a count; the parameters are fitted by
non-negative least squares):
- compute: the busiest rank, seconds_per_pair x its pairs + seconds_per_local_expert x the experts
  it runs (one grouped-GEMM tile set each) + fixed_seconds;
- all-to-all, dispatch and combine alike: Aurora's bound ([aurora]), the busiest rank's send or receive bytes
  over the link bandwidth (NVLink-class inside a node, network-class across), plus a fixed cost per
  peer message ([serving-2026]: small messages are latency-bound).
Traffic follows the runtime's replica choice: tokens start evenly over ranks and use a replica on
their own rank, else on their own node (spread evenly), else any (spread evenly).

A plan's migration stall is the bytes it moves over the migration bandwidth; applied a few layers
per step (as TensorRT-LLM does), each step stalls for its own layers' bytes only.

`whatif` sweeps use a balanced routing model instead of a placement: pairs per rank N k / W, the
busiest rank above it by about sqrt(2 ln W) Poisson standard deviations. With one expert per rank
the compute falls as experts (and ranks) grow while messages and cross-node bytes grow: the U-shaped
latency against expert count of [serving-2026].

Sizes: L layers, E experts, P slots, W ranks, N nodes, G = W / N ranks per node.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Iterable

import numpy as np

from .placement_math import holders


@dataclass(frozen=True)
class CostModel:
    """Parameters of a layer's time; the defaults are an H100-class node (documented guesses,
    replaced by `fit` as soon as Windows are available)."""

    seconds_per_pair: float = 2.2e-7  # expert FFN, d=7168, ffn=2048, bf16: 88 MFLOP at ~400 TFLOP/s
    seconds_per_local_expert: float = 26e-6  # streaming that expert's 88 MB of weights from 3.35 TB/s HBM
    fixed_seconds: float = 2e-5
    seconds_per_byte_intra: float = 1.0 / 700e9  # [serving-2026]: NVLink all-to-all about 700 GB/s in practice
    seconds_per_byte_inter: float = 1.0 / 22e9  # [serving-2026]: 200 Gb/s InfiniBand about 22 GB/s
    seconds_per_message: float = 3e-6
    migration_bytes_per_second: float = 50e9

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostModel":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"cost model: unknown parameter {unknown[0]!r}")
        values = {}
        for key, value in data.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"cost model: {key} must be a finite number >= 0, got {value!r}")
            values[key] = float(value)
        return cls(**values)


# --- traffic under the runtime's replica choice -------------------------------------------------

def expected_traffic(load: np.ndarray, pmap: np.ndarray, num_gpus: int, num_nodes: int = 1) -> np.ndarray:
    """[L, E] load, [L, P] placement -> [L, W, W] expected pairs from rank i to rank j (diagonal:
    local), tokens even over ranks, replica chosen on own rank, else own node, else any."""
    load = np.asarray(load, dtype=np.float64)
    L, E = load.shape
    W, N = num_gpus, num_nodes
    G = W // N
    held = holders(pmap, E, W).astype(np.float64)  # [L, E, W]
    node_of = np.arange(W) // G
    same_node = (node_of[:, None] == node_of[None, :]).astype(np.float64)  # [W, W]
    out = np.empty((L, W, W))
    for layer in range(L):
        h = held[layer]  # [E, W]
        here = h > 0
        on_node = np.einsum("ew,wv->ev", h, same_node)  # [E, W]: replicas on each source rank's node
        total = h.sum(axis=1, keepdims=True)
        # destination share [E, src, dst]
        share = np.where(here[:, :, None], np.eye(W)[None, :, :], 0.0)
        node_pick = (h[:, None, :] * same_node[None, :, :]) / np.maximum(on_node[:, :, None], 1e-300)
        any_pick = np.broadcast_to((h / np.maximum(total, 1e-300))[:, None, :], (E, W, W))
        fallback = np.where((on_node > 0)[:, :, None], node_pick, any_pick)
        share = np.where(here[:, :, None], share, fallback)
        out[layer] = np.einsum("e,esd->sd", load[layer] / W, share)
    return out


def rank_traffic(traffic: np.ndarray, num_nodes: int = 1) -> dict[str, np.ndarray]:
    """[L, W, W] pairs -> per rank [L, W]: pairs computed, sent and received, each split into
    intra-node and inter-node."""
    L, W, _ = traffic.shape
    node_of = np.arange(W) // (W // num_nodes)
    same = node_of[:, None] == node_of[None, :]
    off = ~np.eye(W, dtype=bool)
    intra, inter = off & same, ~same
    return {
        "computed": traffic.sum(axis=1),
        "send_intra": (traffic * intra).sum(axis=2),
        "send_inter": (traffic * inter).sum(axis=2),
        "recv_intra": (traffic * intra).sum(axis=1),
        "recv_inter": (traffic * inter).sum(axis=1),
    }


def layer_seconds(model: CostModel, load: np.ndarray, pmap: np.ndarray, num_gpus: int,
                  hidden_bytes: int, num_nodes: int = 1, rank_speed: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """[L, E] load (pairs per step), [L, P] placement -> per layer [L]: compute, all-to-all
    (dispatch + combine) and total seconds per step. rank_speed: [W] relative speeds (the model's
    parameters are a rank of speed 1.0; a rank at 0.5 computes its work in twice the time); None:
    equal speeds."""
    E = load.shape[1]
    W = num_gpus
    per = rank_traffic(expected_traffic(load, pmap, W, num_nodes), num_nodes)
    experts_on_rank = (holders(pmap, E, W) > 0).sum(axis=1)  # [L, W]
    work = model.seconds_per_pair * per["computed"] + model.seconds_per_local_expert * experts_on_rank
    if rank_speed is not None:
        work = work / np.asarray(rank_speed, dtype=np.float64)[None, :]
    compute = work.max(axis=1) + model.fixed_seconds
    one_way = _one_way_seconds(model, per, hidden_bytes, W)
    a2a = 2.0 * one_way
    return {"compute": compute, "a2a": a2a, "total": compute + a2a}


def _one_way_seconds(model: CostModel, per: dict[str, np.ndarray], hidden_bytes: float, num_gpus: int) -> np.ndarray:
    send = per["send_intra"] * model.seconds_per_byte_intra + per["send_inter"] * model.seconds_per_byte_inter
    recv = per["recv_intra"] * model.seconds_per_byte_intra + per["recv_inter"] * model.seconds_per_byte_inter
    busiest = np.maximum(send, recv).max(axis=1) * hidden_bytes
    return busiest + model.seconds_per_message * (num_gpus - 1)


def migration_stall(model: CostModel, experts_moved_per_layer: np.ndarray, expert_bytes: float,
                    layers_per_step: int | None = None) -> dict[str, float]:
    """[L] experts moved -> stall seconds: all at once, and per step when `layers_per_step`
    changed layers are applied each step (with the number of steps that takes)."""
    moved = np.asarray(experts_moved_per_layer, dtype=np.float64)
    per_layer = moved * float(expert_bytes) / model.migration_bytes_per_second
    out = {"bytes_moved": float(moved.sum() * expert_bytes), "stall_seconds": float(per_layer.sum())}
    if layers_per_step:
        changed = per_layer[per_layer > 0]
        steps = max(1, math.ceil(changed.size / layers_per_step)) if changed.size else 0
        chunks = [changed[i:i + layers_per_step].sum() for i in range(0, changed.size, layers_per_step)]
        out.update(steps=steps, max_step_stall_seconds=float(max(chunks, default=0.0)))
    return out


def plan_gain_seconds(model: CostModel, load: np.ndarray, old: np.ndarray, new: np.ndarray, num_gpus: int,
                      hidden_bytes: int, num_nodes: int = 1) -> float:
    """Predicted layer time saved per step by `new` over `old`, summed over layers (compare with a
    migration stall to decide whether a plan pays off)."""
    before = layer_seconds(model, load, old, num_gpus, hidden_bytes, num_nodes)["total"].sum()
    after = layer_seconds(model, load, new, num_gpus, hidden_bytes, num_nodes)["total"].sum()
    return float(before - after)


# --- sweeps without a placement ------------------------------------------------------------------

def uniform_layer_seconds(model: CostModel, num_experts: int, num_ranks: int, tokens: int, top_k: int,
                          hidden_bytes: int, ranks_per_node: int = 8) -> dict[str, float]:
    """Predicted seconds of one layer step with E experts spread evenly over W ranks, `tokens`
    tokens spread evenly over ranks, routing uniform (Poisson spread of pairs per rank)."""
    E, W, N_tok, k = num_experts, num_ranks, tokens, top_k
    G = min(ranks_per_node, W)
    pairs = N_tok * k / W  # per rank, mean
    busiest = pairs + math.sqrt(pairs) * math.sqrt(2.0 * math.log(W)) if W > 1 else pairs
    compute = model.seconds_per_pair * busiest + model.seconds_per_local_expert * (E / W) + model.fixed_seconds
    # a rank's pairs go to each rank alike: (G - 1) / W of them inside its node, (W - G) / W across
    intra_bytes = busiest * (G - 1) / W * hidden_bytes
    inter_bytes = busiest * (W - G) / W * hidden_bytes
    one_way = intra_bytes * model.seconds_per_byte_intra + inter_bytes * model.seconds_per_byte_inter
    one_way += model.seconds_per_message * (W - 1)
    return {"compute": compute, "a2a": 2.0 * one_way, "total": compute + 2.0 * one_way}


def sweep(model: CostModel, experts: Iterable[int], ranks: Iterable[int] | None, tokens: Iterable[int],
          top_k: int, hidden_bytes: int, ranks_per_node: int = 8, experts_per_rank: int = 1) -> list[dict[str, Any]]:
    """Rows of (experts, ranks, tokens, compute, a2a, total seconds). With `ranks` None each
    expert count runs on experts / experts_per_rank ranks; otherwise every listed rank count that
    divides the expert count is used. Expert counts below top_k are skipped."""
    rows = []
    for E in experts:
        if E < top_k:
            continue
        rank_list = [max(1, E // experts_per_rank)] if ranks is None else [W for W in ranks if W <= E and E % W == 0]
        for W in rank_list:
            for N_tok in tokens:
                t = uniform_layer_seconds(model, E, W, N_tok, top_k, hidden_bytes, ranks_per_node)
                rows.append({"experts": E, "ranks": W, "tokens": N_tok, **t})
    return rows


# --- fitting from Windows --------------------------------------------------------------------------

@dataclass(frozen=True)
class FitReport:
    samples_compute: int
    samples_a2a: int
    fitted: tuple[str, ...]  # parameters the data could pin down; the others kept their values
    r2_compute: float
    r2_a2a: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fit(windows: Iterable[Any], base: CostModel | None = None, rounds: int = 4) -> tuple[CostModel, FitReport]:
    """Least-squares fit (non-negative) of the model's parameters to measured Windows.

    Compute: each (window, layer, rank) is a sample, compute seconds per step against the rank's
    pairs per step, its experts, and 1. All-to-all: each (window, layer) is a sample, the slowest
    rank's dispatch + combine per step against the busiest rank's intra- and inter-node bytes per
    step, twice (dispatch and combine), and twice the peer count. Which rank and direction is the
    busiest depends on the bandwidths being fitted, so it is picked with the current estimate and
    the fit repeated (`rounds`). Bytes per rank come from `traffic` when the window carries it,
    else from sent/received split by the share of peers on other nodes. A parameter whose feature
    never varies keeps its base value (one constant feature is fitted as the intercept).
    """
    model = base or CostModel()
    comp_x, comp_y, a2a_bytes, a2a_peers, a2a_y = [], [], [], [], []
    # Only windows that measured what the model is fitted to (absent evidence is never filled in).
    needed = ("local_tokens", "sent_tokens", "received_tokens", "compute_seconds", "dispatch_seconds",
              "combine_seconds")
    for w in windows:
        if any(getattr(w, name, None) is None for name in needed):
            continue
        steps = max(w.steps, 1)
        W, G = w.world_size, min(w.ranks_per_node, w.world_size)
        N = max(W // G, 1)
        pairs = (w.local_tokens + w.received_tokens) / steps  # [L, W]
        experts = (holders(w.physical_to_logical_map, w.num_experts, W) > 0).sum(axis=1)
        comp_x.append(np.stack([pairs.ravel(), experts.ravel().astype(np.float64), np.ones(pairs.size)], axis=1))
        comp_y.append((w.compute_seconds / steps).ravel())
        if w.traffic is not None:
            per = rank_traffic(np.asarray(w.traffic, dtype=np.float64), N)
        else:
            inter_share = (W - G) / max(W - 1, 1)
            per = {"send_intra": w.sent_tokens * (1 - inter_share), "send_inter": w.sent_tokens * inter_share,
                   "recv_intra": w.received_tokens * (1 - inter_share), "recv_inter": w.received_tokens * inter_share}
        scale = w.hidden_bytes / steps
        # [L, 2 W, 2]: each rank and direction's (intra, inter) bytes per step
        both = np.concatenate([np.stack([per["send_intra"], per["send_inter"]], axis=2),
                               np.stack([per["recv_intra"], per["recv_inter"]], axis=2)], axis=1) * scale
        a2a_bytes.extend(both)
        a2a_peers.extend([2.0 * (W - 1)] * w.num_layers)
        a2a_y.extend(((w.dispatch_seconds + w.combine_seconds).max(axis=1) / steps).tolist())
    if not comp_y:
        raise ValueError("windows: nothing to fit (no windows with rank-level counts and timings)")
    comp_names = ("seconds_per_pair", "seconds_per_local_expert", "fixed_seconds")
    a2a_names = ("seconds_per_byte_intra", "seconds_per_byte_inter", "seconds_per_message")
    comp_coef, comp_fit, r2c = _nnls_fit(np.concatenate(comp_x), np.concatenate(comp_y),
                                         [getattr(model, n) for n in comp_names])
    y = np.array(a2a_y)
    coef = [getattr(model, n) for n in a2a_names]
    for _ in range(max(rounds, 1)):
        per_byte = np.array(coef[:2])
        x = np.array([b[np.argmax(b @ per_byte)] for b in a2a_bytes])  # busiest rank and direction
        x = np.column_stack([2.0 * x, np.array(a2a_peers)])
        coef, a2a_fit, r2a = _nnls_fit(x, y, [getattr(model, n) for n in a2a_names])
    changes = {n: c for n, c, f in zip(comp_names + a2a_names, comp_coef + coef, comp_fit + a2a_fit) if f}
    fitted = tuple(n for n, f in zip(comp_names + a2a_names, comp_fit + a2a_fit) if f)
    report = FitReport(int(sum(len(c) for c in comp_y)), len(a2a_y), fitted, r2c, r2a)
    return replace(model, **changes), report


def fit_or_default(windows: Iterable[Any], base: CostModel) -> CostModel:
    """`fit` of the windows over `base` (parameters the windows cannot pin down keep base's), or base
    itself when the fit fails."""
    try:
        model, _ = fit(windows, base)
    except (ValueError, np.linalg.LinAlgError):
        return base
    return model


def _nnls_fit(x: np.ndarray, y: np.ndarray, base: list[float]) -> tuple[list[float], list[bool], float]:
    """Fit y ~ x @ coef, coef >= 0, using only the columns that vary (a constant column is the
    intercept when it is the only constant one); the others stay at `base` (their part subtracted)."""
    # Imported on first use: scipy.optimize is most of the agent's start-up CPU (about 0.6 s), which
    # a restarted sidecar would otherwise take from the inference ranks before it has anything to fit.
    from scipy.optimize import nnls

    varies = x.std(axis=0) > 1e-12 * (np.abs(x).max(axis=0) + 1e-300)
    constant = ~varies & (np.abs(x).max(axis=0) > 0)
    # one constant column can be fitted as the intercept; several constants are not separable
    use = varies.copy()
    if constant.sum() >= 1:
        use[np.flatnonzero(constant)[-1]] = True
    keep = ~use
    target = y - x[:, keep] @ np.array(base)[keep] if keep.any() else y
    coef = list(base)
    if use.any():
        solved, _ = nnls(x[:, use], target)
        for i, value in zip(np.flatnonzero(use), solved):
            coef[i] = float(value)
    pred = x @ np.array(coef)
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return coef, [bool(u) for u in use], r2
