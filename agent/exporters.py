"""Prometheus export: one collector and one cached exposition that render the agent's metric state.

The series live in `MetricsState` (agent/metrics/state.py), written through the families each
concern declares (agent/metrics/); the catalogue (agent/catalog.py) lists every family in
exposition order. A scrape only copies the state out (`AgentCollector`, or the cached `Exposition`
that a recorded window refreshes); nothing outside the catalogue can leak into /metrics.
"""

from __future__ import annotations

import operator
import threading
from typing import Any, Iterable, Iterator

import numpy as np
from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .catalog import METRICS
from .metrics.family import Family, Labels
from .metrics.state import Chunk, MetricsState

disable_created_metrics()

# --- the collector ------------------------------------------------------------------------------

_FAMILY = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}


class AgentCollector(Collector):
    """Yields every catalogue family on each scrape (empty families included), from the state."""

    def __init__(self, state: MetricsState):
        self.state = state

    def collect(self) -> Iterator[Any]:
        for spec in METRICS:
            if spec.kind == "histogram":
                family = HistogramMetricFamily(spec.name, spec.help, labels=list(spec.labels))
                for labels, buckets, total in self.state.histogram_series(spec):
                    family.add_metric(list(labels), buckets, total)
            else:
                # CounterMetricFamily takes the name without _total and adds it to the samples.
                base = spec.name[:-len("_total")] if spec.kind == "counter" else spec.name
                family = _FAMILY[spec.kind](base, spec.help, labels=list(spec.labels))
                for labels, value in self.state.series(spec):
                    family.add_metric(list(labels), value)
            yield family


class Exposition:
    """The /metrics text (Prometheus text format 0.0.4, byte for byte what prometheus_client's
    generate_latest writes for the same state), kept per (family, chunk): a chunk is rendered again
    only when its version moved, so a window re-renders its own group's lines once and a scrape
    copies bytes. Label strings are cached per series."""

    def __init__(self, state: MetricsState):
        self.state = state
        self._lock = threading.Lock()
        self._chunks: dict[tuple[str, Chunk], tuple[int, bytes]] = {}
        self._headers = {spec.name: self._header(spec) for spec in METRICS}
        self._labels: dict[tuple[str, Labels], str] = {}
        self._buckets: dict[tuple[str, Labels], list[str]] = {}
        self._prefixes: dict[tuple[str, Chunk], tuple[list[Labels], list[str]]] = {}
        self._whole: tuple[int, bytes] | None = None  # (state generation, the exposition at it)

    @staticmethod
    def _header(spec: Family) -> bytes:
        help_text = spec.help.replace("\\", r"\\").replace("\n", r"\n")
        kind = "histogram" if spec.kind == "histogram" else spec.kind
        return f"# HELP {spec.name} {help_text}\n# TYPE {spec.name} {kind}\n".encode()

    def _label_text(self, spec: Family, key: Labels, extra: tuple[tuple[str, str], ...] = ()) -> str:
        cache_key = (spec.name, key + tuple(v for _, v in extra))
        text = self._labels.get(cache_key)
        if text is None:
            pairs = sorted([*zip(spec.labels, key), *extra])
            text = "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}" if pairs else ""
            if len(self._labels) > 200_000:  # series come and go (retired groups): never grow unbounded
                self._labels.clear()
                self._buckets.clear()
            self._labels[cache_key] = text
        return text

    def _bucket_labels(self, spec: Family, key: Labels, buckets: list[tuple[str, float]]) -> list[str]:
        cache_key = (spec.name + "_bucket", key)
        texts = self._buckets.get(cache_key)
        if texts is None:
            texts = self._buckets[cache_key] = [self._label_text(spec, key, (("le", le),)) for le, _ in buckets]
        return texts

    def _render_chunk(self, spec: Family, chunk: Chunk) -> bytes:
        lines = []
        name = spec.name
        if spec.kind == "histogram":
            series = self.state.chunk_series(spec, chunk)
            # One go_floats for the whole chunk: its fixed cost once, not once per series.
            texts = iter(go_floats([value for _, (buckets, total) in series
                                    for value in [*(count for _, count in buckets), total]]))
            for key, (buckets, _) in series:
                counts = [next(texts) for _ in buckets]
                total_text = next(texts)
                for le_labels, count in zip(self._bucket_labels(spec, key, buckets), counts):
                    lines.append(f"{name}_bucket{le_labels} {count}\n")
                labels = self._label_text(spec, key)
                lines.append(f"{name}_count{labels} {counts[-1]}\n")
                lines.append(f"{name}_sum{labels} {total_text}\n")
        else:
            keys, values = self.state.chunk_columns(spec, chunk)
            if not keys:
                return b""
            # The text before each value, kept while the chunk holds the same series in the same order.
            cached = self._prefixes.get((name, chunk))
            if cached is None or cached[0] != keys:
                cached = (keys, [f"{name}{self._label_text(spec, key)} " for key in keys])
                self._prefixes[(name, chunk)] = cached
            lines = map(operator.add, cached[1], go_floats(values))
            return ("\n".join(lines) + "\n").encode()
        return "".join(lines).encode()

    def render(self) -> bytes:
        with self._lock:
            # Read before the chunks: a change made while they are read moves it past what is kept.
            generation = self.state.generation
            if self._whole is not None and self._whole[0] == generation:
                return self._whole[1]  # a scrape between windows: the bytes as they were
            out = []
            live = set()
            for spec in METRICS:
                out.append(self._headers[spec.name])
                for chunk, version in self.state.chunks(spec):
                    live.add((spec.name, chunk))
                    cached = self._chunks.get((spec.name, chunk))
                    if cached is None or cached[0] != version:
                        cached = (version, self._render_chunk(spec, chunk))
                        self._chunks[(spec.name, chunk)] = cached
                    out.append(cached[1])
            for gone in set(self._chunks) - live:
                del self._chunks[gone]
                self._prefixes.pop(gone, None)
            whole = b"".join(out)
            self._whole = (generation, whole)
            return whole


def go_floats(values: list[float]) -> list[str]:
    """prometheus_client's floatToGoString of each value, without its general path for the common
    case: Python's repr is already Go's text for a finite float under 1e6 in magnitude (Go switches
    to an exponent sooner than Python above that, and spells inf and nan its own way)."""
    texts = list(map(repr, map(float, values)))
    magnitude = np.abs(np.asarray(values, dtype=np.float64))
    for i in np.flatnonzero(~(magnitude < 1e6)).tolist():
        texts[i] = floatToGoString(values[i])
    return texts


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


class AgentRegistry(CollectorRegistry):
    """A registry holding only the agent's collector, with the cached exposition beside it."""

    def __init__(self, state: MetricsState):
        super().__init__(auto_describe=False)
        self.register(AgentCollector(state))
        self.exposition = Exposition(state)
        # Render what a window changed once, when it is recorded, so a scrape only copies bytes.
        state.on_window.append(self.exposition.render)


def make_registry(state: MetricsState) -> CollectorRegistry:
    """A registry holding only the agent's collector: nothing outside the catalogue is exported."""
    return AgentRegistry(state)


def render(registry: CollectorRegistry) -> bytes:
    """The exposition: the agent's cached one, else prometheus_client's."""
    if isinstance(registry, AgentRegistry):
        return registry.exposition.render()
    return generate_latest(registry)


def family_names(exposition: str) -> set[str]:
    """Metric family names declared (# TYPE) in a text exposition."""
    return {line.split()[2] for line in exposition.splitlines() if line.startswith("# TYPE ")}


def sample_names(exposition: str) -> Iterable[str]:
    for line in exposition.splitlines():
        if line and not line.startswith("#"):
            yield line.split("{", 1)[0].split(" ", 1)[0]
