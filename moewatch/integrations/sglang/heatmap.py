"""SGLang's /metrics heatmap as per-rank load per layer, from successive scrapes.

`sglang:eplb_gpu_physical_count` (python/sglang/srt/observability/metrics_collector.py,
ExpertDispatchCollector; filled in python/sglang/srt/eplb/expert_distribution.py,
`_handle_metric_eplb_heatmap`) is a histogram labelled `layer` whose finite buckets are the EP
ranks 0..W-1: each sampled forward pass adds the pairs rank r computed into bucket r. The exposition
is cumulative, so rank r's count is bucket(le=r) - bucket(le=r-1). Rank 0 emits it, and only when
SGLANG_EPLB_HEATMAP_COLLECTION_INTERVAL > 0: every interval-th forward pass is sampled, so the
counts are a sample of the passes, not all of them.

Counters only grow while SGLang runs; a window is the difference between two scrapes. A restarted
server starts from zero: when any of a layer's counts went down, the new values are the counts since
the restart and count whole. The first scrape is a baseline and yields nothing.

What it measures is rank load per layer [L, W] (its balancedness, its max/mean): no per-expert
counts, no timings, no placement. Each difference becomes a Window carrying those per-rank totals as
`rank_tokens` (the contract's stand-in for `expert_tokens`, docs/telemetry.md): per-expert counts,
capacity counts, timings and per-step data absent, `steps` 0 (the heatmap counts pairs, not
passes). The placement in force is not in the exposition, so the caller gives it: the
`--init-expert-location` file SGLang was started with, or SGLang's default placement (slot s holds
expert s, P = E; no redundant experts) for a known number of experts.

Sizes: L layers, W ranks, E experts, P slots.
"""

from __future__ import annotations

import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from ...telemetry import Window, WindowError
from ..base import SourceError

METRIC = "sglang:eplb_gpu_physical_count"
RUNTIME = "sglang"
# What a heatmap window cannot carry: absent in the window, or (scalars) a stated default.
NOT_IN_METRICS = ["expert_tokens", "slot_tokens", "dropped_tokens", "rerouted_tokens", "timings", "steps", "top_k",
                  "hidden_bytes", "ranks_per_node"]


@dataclass(frozen=True)
class RankLoad:
    """Pairs each rank computed per layer between two scrapes (sampled passes only)."""

    start_time: float
    end_time: float
    load: np.ndarray  # [L, W] int64
    reset: bool  # the server restarted between the scrapes

    @property
    def balancedness(self) -> np.ndarray:
        """[L] mean/max over ranks (1.0 for an idle layer), the convention of SGLang's own metric."""
        load = self.load.astype(np.float64)
        top = load.max(axis=1)
        out = np.ones(load.shape[0])
        np.divide(load.mean(axis=1), top, out=out, where=top > 0)
        return out

    def to_dict(self) -> dict:
        return {"start_time": self.start_time, "end_time": self.end_time, "reset": self.reset,
                "rank_load": self.load.tolist(), "balancedness": [round(float(b), 6) for b in self.balancedness]}


def parse_heatmap(text: str, label: str = "<exposition>") -> np.ndarray | None:
    """Cumulative per-rank counts [L, W] from a Prometheus text exposition; None when the metric is
    not there (the heatmap is off, or nothing was sampled yet)."""
    layers: dict[int, dict[float, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name != METRIC:
                continue
            for sample in family.samples:
                if not sample.name.endswith("_bucket"):
                    continue
                try:
                    layer = int(sample.labels["layer"])
                    bound = float(sample.labels["le"])
                except (KeyError, ValueError):
                    raise SourceError(label, f"{METRIC}: a bucket without a numeric layer or le label") from None
                layers.setdefault(layer, {})[bound] = sample.value
    except SourceError:
        raise
    except Exception as exc:  # the parser raises ValueError and friends on a malformed exposition
        raise SourceError(label, f"not a Prometheus text exposition ({exc})") from None
    if not layers:
        return None
    bounds = sorted(b for b in next(iter(layers.values())) if math.isfinite(b))
    if bounds != [float(r) for r in range(len(bounds))] or not bounds:
        raise SourceError(label, f"{METRIC}: buckets {bounds} are not the ranks 0..W-1")
    L, W = max(layers) + 1, len(bounds)
    cumulative = np.zeros((L, W), dtype=np.float64)
    for layer, buckets in layers.items():
        if layer < 0 or sorted(b for b in buckets if math.isfinite(b)) != bounds:
            raise SourceError(label, f"{METRIC}: layer {layer} has buckets unlike layer {min(layers)}'s")
        cumulative[layer] = [buckets[b] for b in bounds]
    per_rank = np.diff(cumulative, axis=1, prepend=0.0)
    if np.any(per_rank < 0) or not np.all(np.isfinite(per_rank)) or np.any(per_rank != np.round(per_rank)):
        raise SourceError(label, f"{METRIC}: buckets are not cumulative whole counts")
    return per_rank.astype(np.int64)


class HeatmapScraper:
    """Successive scrapes of one SGLang /metrics URL -> RankLoad between them."""

    def __init__(self, url: str, *, timeout_seconds: float = 5.0, clock: Callable[[], float] = time.time,
                 fetch: Callable[[str, float], str] | None = None):
        self.url = url
        self.timeout_seconds = timeout_seconds
        self.clock = clock
        self.fetch = fetch or _http_get
        self._previous: np.ndarray | None = None
        self._previous_time = 0.0
        self.scrapes = 0
        self.resets = 0

    def scrape(self) -> RankLoad | None:
        """One scrape; the RankLoad since the previous one, or None (baseline, metric absent, idle)."""
        text = self.fetch(self.url, self.timeout_seconds)
        now = self.clock()
        current = parse_heatmap(text, self.url)
        self.scrapes += 1
        if current is None:
            return None
        previous, start = self._previous, self._previous_time
        self._previous, self._previous_time = current, now
        if previous is None:
            return None
        return diff(previous, current, start, now)


def diff(previous: np.ndarray, current: np.ndarray, start: float, end: float) -> RankLoad | None:
    """RankLoad from two cumulative [L, W] scrapes; a layer whose counts went down restarted (its
    current counts are all new). Layers or ranks that appeared count from zero."""
    L, W = current.shape
    if W != previous.shape[1]:
        return RankLoad(start, end, current.copy(), True)  # the EP size changed: a new server
    before = np.zeros_like(current)
    rows = min(L, previous.shape[0])
    before[:rows] = previous[:rows]
    went_down = np.any(current < before, axis=1)
    delta = np.where(went_down[:, None], current, current - before)
    if not delta.any():
        return None
    return RankLoad(start, end, delta, bool(went_down.any()))


def default_placement(num_layers: int, num_experts: int) -> np.ndarray:
    """[L, E] SGLang's placement when it runs without --init-expert-location and without redundant
    experts: slot s holds expert s (its trivial map, s mod E, with P = E)."""
    return np.tile(np.arange(num_experts, dtype=np.int64), (num_layers, 1))


def heatmap_window(sample: RankLoad, physical_to_logical_map: np.ndarray, *, model: str = "sglang",
                   ep_group: str = "ep0", label: str = "<heatmap>") -> Window:
    """A RankLoad [L', W] as a Window of per-rank totals under the placement [L, P] in force.

    Layers the exposition has not shown yet (a layer appears once it was sampled) computed nothing:
    rank_tokens is zero there. A heatmap wider than the placement, or ranks that do not divide the
    slots, is refused (SourceError naming the URL)."""
    pmap = np.asarray(physical_to_logical_map, dtype=np.int64)
    L, W = pmap.shape[0], sample.load.shape[1]
    if sample.load.shape[0] > L:
        raise SourceError(label, f"{METRIC}: {sample.load.shape[0]} layers, but the placement has {L}")
    rank_tokens = np.zeros((L, W), dtype=np.int64)
    rank_tokens[:sample.load.shape[0]] = sample.load
    try:
        return Window(runtime=RUNTIME, model=model, ep_group=ep_group, world_size=W, ranks_per_node=W, num_layers=L,
                      num_experts=int(pmap.max()) + 1 if pmap.size else 0, num_slots=pmap.shape[1], top_k=1, epoch=0,
                      steps=0, start_time=sample.start_time, end_time=sample.end_time, hidden_bytes=0,
                      physical_to_logical_map=pmap, capacity_factor=np.zeros(L), rank_tokens=rank_tokens,
                      extra={"source": {"kind": "sglang-metrics-heatmap", "url": label, "reset": sample.reset,
                                        "sampled_passes_only": True, "not_in_metrics": NOT_IN_METRICS}})
    except WindowError as exc:
        raise SourceError(label, f"does not make a valid window with the placement in force: {exc}") from None


def _http_get(url: str, timeout: float) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (configured http(s) URL)
            return response.read(64 * 1024 * 1024).decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise SourceError(url, f"scrape failed ({getattr(exc, 'reason', exc)})") from None
