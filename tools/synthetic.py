"""Synthetic expert loads and routing traces with known structure, for the benchmark and the tests.

Loads are pair counts [L, E] drawn as multinomials over a per-layer popularity, so they look like
what a recorder counts. The routing trace has a planted inter-layer affinity: each token has a
hidden topic, and a topic prefers a fixed set of experts in every layer, so a good placement can
keep a topic's experts on one GPU.
"""

from __future__ import annotations

import numpy as np

LOAD_KINDS = ("lognormal", "zipf", "hot")


def popularity(kind: str, num_layers: int, num_experts: int, rng: np.random.Generator) -> np.ndarray:
    """[L, E] routing probabilities per layer (rows sum to 1).

    lognormal: exp(N(0, 1)) per expert; zipf: 1 / rank over a random permutation (Zipf, s = 1);
    hot: lognormal(0, 0.5) with 4 experts per layer taking 8-20 times the mean each.
    """
    L, E = num_layers, num_experts
    if kind == "lognormal":
        weight = rng.lognormal(0.0, 1.0, size=(L, E))
    elif kind == "zipf":
        ranks = np.argsort(rng.random((L, E)), axis=1) + 1
        weight = 1.0 / ranks
    elif kind == "hot":
        weight = rng.lognormal(0.0, 0.5, size=(L, E))
        hot = np.argsort(rng.random((L, E)), axis=1)[:, :min(4, E)]
        factor = rng.uniform(8.0, 20.0, size=hot.shape) * weight.mean(axis=1, keepdims=True)
        np.put_along_axis(weight, hot, factor, axis=1)
    else:
        raise ValueError(f"kind: expected one of {LOAD_KINDS}, got {kind!r}")
    return weight / weight.sum(axis=1, keepdims=True)


def sample_load(probabilities: np.ndarray, pairs_per_layer: int, rng: np.random.Generator) -> np.ndarray:
    """[L, E] probabilities -> [L, E] int64 pair counts (multinomial per layer)."""
    return np.stack([rng.multinomial(pairs_per_layer, row) for row in probabilities]).astype(np.int64)


def synthetic_load(kind: str, num_layers: int, num_experts: int, pairs_per_layer: int = 16384 * 8,
                   seed: int = 0) -> np.ndarray:
    """[L, E] int64 pair counts of the given kind."""
    rng = np.random.default_rng(seed)
    return sample_load(popularity(kind, num_layers, num_experts, rng), pairs_per_layer, rng)


def drifted(probabilities: np.ndarray, rng: np.random.Generator, sigma: float = 0.3,
            new_hot: int = 2) -> np.ndarray:
    """[L, E] probabilities after a drift: every expert's share multiplied by exp(N(0, sigma)) and
    `new_hot` experts per layer trading places with the hottest ones."""
    weight = probabilities * rng.lognormal(0.0, sigma, size=probabilities.shape)
    L, E = weight.shape
    for layer in range(L):
        hottest = np.argsort(-weight[layer])[:new_hot]
        others = rng.choice(np.setdiff1d(np.arange(E), hottest), size=new_hot, replace=False)
        weight[layer, hottest], weight[layer, others] = weight[layer, others].copy(), weight[layer, hottest].copy()
    return weight / weight.sum(axis=1, keepdims=True)


def affinity_trace(num_tokens: int, num_layers: int, num_experts: int, top_k: int, num_topics: int,
                   stickiness: float = 0.7, skew: float = 0.5, seed: int = 0,
                   with_topics: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """[T, L, k] int64 expert ids per token and layer, with a planted inter-layer affinity.

    Each token has a topic z; at every layer each of its k choices comes, with probability
    `stickiness`, from topic z's E / num_topics experts of that layer (a random partition of the
    experts, different per layer) and otherwise from all experts; within either set an expert is
    drawn by its lognormal(0, skew) popularity, so loads are uneven and balance still matters. A
    draw that repeats an expert the token already chose at that layer is drawn again (sampling
    without replacement). with_topics=True also returns the planted partition, [L, Z, E / Z]
    expert ids of each topic per layer.
    """
    rng = np.random.default_rng(seed)
    T, L, E, k = num_tokens, num_layers, num_experts, top_k
    if E % num_topics:
        raise ValueError(f"num_topics: {num_topics} does not divide {E} experts")
    if k > E:
        raise ValueError(f"top_k: {k} exceeds {E} experts")
    per_topic = E // num_topics
    members = np.stack([rng.permutation(E).reshape(num_topics, per_topic) for _ in range(L)])  # [L, Z, E/Z]
    pop = rng.lognormal(0.0, skew, size=(L, E))
    topic = rng.integers(0, num_topics, size=T)
    trace = np.empty((T, L, k), dtype=np.int64)
    for layer in range(L):
        own_weight = pop[layer][members[layer]]  # [Z, E/Z]
        own_cdf = np.cumsum(own_weight, axis=1) / own_weight.sum(axis=1, keepdims=True)
        all_cdf = np.cumsum(pop[layer]) / pop[layer].sum()

        def draw(rows: np.ndarray, count: int) -> np.ndarray:
            u = rng.random((rows.size, count))
            in_topic = rng.random((rows.size, count)) < stickiness
            z = topic[rows][:, None]
            pick = (u[:, :, None] > own_cdf[z][:, :, :]).sum(axis=2)  # [rows, count]
            pick = np.minimum(pick, per_topic - 1)
            from_topic = members[layer][np.broadcast_to(z, pick.shape), pick]
            from_all = np.minimum(np.searchsorted(all_cdf, u), E - 1)
            return np.where(in_topic, from_topic, from_all)

        chosen = draw(np.arange(T), k)
        while True:
            order = np.sort(chosen, axis=1)
            repeats = (order[:, 1:] == order[:, :-1]).any(axis=1)
            if not repeats.any():
                break
            rows = np.flatnonzero(repeats)
            sub = chosen[rows]
            # a position repeats when an earlier position holds the same expert
            earlier = (sub[:, :, None] == sub[:, None, :]) & np.tri(k, k, -1, dtype=bool).T[None]
            again = earlier.any(axis=1)
            fresh = draw(rows, k)
            chosen[rows] = np.where(again, fresh, sub)
        trace[:, layer, :] = chosen
    return (trace, members) if with_topics else trace
