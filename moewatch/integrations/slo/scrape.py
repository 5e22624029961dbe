"""An engine's /metrics -> its SLO signals over an interval: latency quantiles from the histograms'
bucket growth between two scrapes (moewatch.slo.SLO_KEY's `quantiles`), and the request gauges."""

from __future__ import annotations

import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from ..base import SourceError
from .engines import ENGINE_METRICS, GAUGES, LATENCIES, engine_of
from .histogram import histogram_quantile

QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Histogram:
    """One histogram summed over its label sets: [B] upper bounds (ascending, +Inf last) and the
    cumulative counts at each, the observations' sum and count."""

    upper_bounds: tuple[float, ...]
    counts: np.ndarray
    total_seconds: float
    count: float


@dataclass(frozen=True)
class Exposition:
    """What one scrape says of the engine's SLO signals (cumulative since the engine started)."""

    engine: str
    time: float
    histograms: dict[str, Histogram]
    gauges: dict[str, float]


def parse_exposition(text: str, now: float, model_name: str | None = None, where: str = "<exposition>"
                     ) -> Exposition:
    """Parse an engine's exposition: each SLO histogram summed over its series (of `model_name` only,
    when given), its buckets keyed by `le`. SourceError when the text is not an exposition or
    carries neither engine's SLO metrics."""
    try:
        families = {f.name: f for f in text_string_to_metric_families(text)}
    except ValueError as e:
        raise SourceError(where, f"not a Prometheus exposition ({e})") from None
    engine = engine_of(set(families))
    if engine is None:
        raise SourceError(where, "carries no vLLM or SGLang latency metrics (time_to_first_token_seconds)")
    names = ENGINE_METRICS[engine]
    histograms: dict[str, Histogram] = {}
    for signal in LATENCIES:
        family = families.get(names[signal])
        if family is None:
            continue
        buckets: dict[float, float] = {}
        total = count = 0.0
        for s in family.samples:
            if model_name is not None and s.labels.get("model_name", model_name) != model_name:
                continue
            if s.name.endswith("_bucket"):
                try:
                    le = float(s.labels["le"])
                except (KeyError, ValueError):
                    raise SourceError(where, f"{s.name}: a bucket without a numeric le label") from None
                buckets[le] = buckets.get(le, 0.0) + float(s.value)
            elif s.name.endswith("_sum"):
                total += float(s.value)
            elif s.name.endswith("_count"):
                count += float(s.value)
        if buckets:
            bounds = tuple(sorted(buckets))
            histograms[signal] = Histogram(bounds, np.array([buckets[b] for b in bounds]), total, count)
    gauges: dict[str, float] = {}
    for signal in GAUGES:
        family = families.get(names[signal])
        if family is not None:
            values = [float(s.value) for s in family.samples
                      if model_name is None or s.labels.get("model_name", model_name) == model_name]
            if values:
                gauges[signal] = float(sum(values))
    return Exposition(engine, now, histograms, gauges)


def interval(previous: Exposition | None, current: Exposition) -> dict[str, Any]:
    """The SLO signals between two scrapes (or since the engine started, with no previous scrape,
    or when a count went down: a restarted engine counts whole), JSON-ready: `engine`, `start_time`,
    `end_time`, `since_start`, `quantiles` {signal: {"p50", "p90", "p99"}} (None: no observation
    in the interval), `counts` {signal: observations}, `mean_seconds`, `gauges`."""
    quantiles: dict[str, dict[str, float | None]] = {}
    counts: dict[str, float] = {}
    means: dict[str, float | None] = {}
    since_start = previous is None or previous.engine != current.engine
    for signal, now in current.histograms.items():
        before = None if since_start else previous.histograms.get(signal)
        counts_now, total, count = now.counts, now.total_seconds, now.count
        if before is not None and before.upper_bounds == now.upper_bounds and before.count <= now.count:
            counts_now = now.counts - before.counts
            total, count = now.total_seconds - before.total_seconds, now.count - before.count
        elif before is not None:
            since_start = True  # restarted (or re-bucketed): what it has counted since it started
        values = {f"p{round(q * 100)}": histogram_quantile(q, now.upper_bounds, counts_now) for q in QUANTILES}
        quantiles[signal] = {k: (v if math.isfinite(v) else None) for k, v in values.items()}
        counts[signal] = float(count)
        means[signal] = total / count if count > 0 else None
    return {"engine": current.engine, "start_time": None if previous is None else previous.time,
            "end_time": current.time, "since_start": since_start, "quantiles": quantiles, "counts": counts,
            "mean_seconds": means, "gauges": dict(current.gauges)}


class SloScraper:
    """Scrapes one engine's /metrics; each scrape after the first gives the interval since the
    previous one."""

    def __init__(self, url: str, *, model_name: str | None = None, timeout_seconds: float = 5.0,
                 clock: Callable[[], float] = time.time, fetch: Callable[[str, float], str] | None = None):
        self.url, self.model_name, self.timeout = url, model_name, timeout_seconds
        self.clock = clock
        self.fetch = fetch or _http_get
        self.previous: Exposition | None = None

    def scrape(self) -> dict[str, Any] | None:
        """The interval since the previous scrape; None for the first (the baseline)."""
        text = self.fetch(self.url, self.timeout)
        current = parse_exposition(text, self.clock(), self.model_name, where=self.url)
        previous, self.previous = self.previous, current
        return None if previous is None else interval(previous, current)


def _http_get(url: str, timeout: float) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (an operator's URL)
            return resp.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError) as e:
        raise SourceError(url, f"cannot scrape: {e}") from None
