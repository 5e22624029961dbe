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
    experts, different per layer) and otherwise from all experts; within a set, experts are picked
    by a lognormal(0, skew) popularity, so loads are uneven and balance still matters. The k
    choices of one token and layer are distinct. with_topics=True also returns the planted
    partition, [L, Z, E / Z] expert ids of each topic per layer.
    """
    rng = np.random.default_rng(seed)
    T, L, E, k = num_tokens, num_layers, num_experts, top_k
    if E % num_topics:
        raise ValueError(f"num_topics: {num_topics} does not divide {E} experts")
    per_topic = E // num_topics
    members = np.stack([rng.permutation(E).reshape(num_topics, per_topic) for _ in range(L)])  # [L, Z, E/Z]
    pop = rng.lognormal(0.0, skew, size=(L, E))
    topic = rng.integers(0, num_topics, size=T)
    trace = np.empty((T, L, k), dtype=np.int64)
    for layer in range(L):
        own = members[layer][topic]  # [T, E/Z]
        own_w = pop[layer][own]
        # Gumbel top-k over a score that favours the topic's experts: distinct picks, weighted.
        score = np.log(np.broadcast_to(pop[layer], (T, E)) * (1.0 - stickiness) / E)
        in_topic = np.full((T, E), -np.inf)
        np.put_along_axis(in_topic, own, np.log(stickiness * own_w / own_w.sum(axis=1, keepdims=True)), axis=1)
        score = np.logaddexp(score, in_topic) + rng.gumbel(size=(T, E))
        trace[:, layer, :] = np.argsort(-score, axis=1)[:, :k]
    return (trace, members) if with_topics else trace
