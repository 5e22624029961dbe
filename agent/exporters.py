"""Prometheus export: the agent's metric state and one collector that renders it.

`MetricsState` holds every series the agent exports, keyed by the catalogue's names (agent/catalog.py):
gauges and counters as values, histograms as bucket counts. The jobs write it (a window's numbers are
computed once, by the triage job, in `record_window`); a scrape only copies it out (`AgentCollector`),
and the OpenTelemetry bridge (agent/otel.py) reads the same state. A name or label set outside the
catalogue is a programming error and raises, so nothing outside the contract can leak into /metrics.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np
from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from moewatch import __version__
from moewatch import telemetry as tm
from moewatch.telemetry import Window
from moewatch.triage import WindowDiagnosis

from .catalog import A2A_STEP_BUCKETS, BY_NAME, EXPERT_LOAD_SHARE_BUCKETS, METRICS, STEP_BUCKETS

disable_created_metrics()

BUCKETS = {
    "moewatch_layer_a2a_step_seconds": A2A_STEP_BUCKETS,
    "moewatch_layer_expert_load_share": EXPERT_LOAD_SHARE_BUCKETS,
    "moewatch_step_seconds": STEP_BUCKETS,
}
Labels = tuple[str, ...]


@dataclass
class HistogramValue:
    """Counts per bucket (not cumulative), last slot for +Inf; sum and count of observations."""

    bounds: tuple[float, ...]
    counts: np.ndarray = field(init=False)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = np.zeros(len(self.bounds) + 1, dtype=np.int64)

    def observe(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float64).ravel()
        values = values[np.isfinite(values)]
        if values.size == 0:
            return
        # Prometheus buckets are upper-inclusive (le): searchsorted 'left' puts x == bound inside it.
        idx = np.searchsorted(np.asarray(self.bounds), values, side="left")
        self.counts += np.bincount(idx, minlength=len(self.bounds) + 1)
        self.total += float(values.sum())
        self.count += int(values.size)

    def cumulative(self) -> list[tuple[str, float]]:
        cum = np.cumsum(self.counts).astype(np.float64).tolist()
        return list(zip(_bound_texts(self.bounds), cum))


@functools.lru_cache(maxsize=None)
def _bound_texts(bounds: tuple[float, ...]) -> tuple[str, ...]:
    """The `le` label values of a histogram's buckets, +Inf last."""
    return (*(repr(float(b)) for b in bounds), "+Inf")


def _chunk_of(spec) -> Callable[[Labels], tuple[str, ...]]:
    """Series of one EP group form a chunk of their family (rendered and versioned together), so a
    window of one group re-renders only that group's lines; agent-wide series form one chunk."""
    if spec.labels[:2] == ("model", "ep_group"):
        return lambda labels: labels[:2]
    return lambda labels: ()


_CHUNK = {m.name: _chunk_of(m) for m in METRICS}
Chunk = tuple[str, ...]


class MetricsState:
    """Every exported series. Thread-safe. Writers name a catalogue metric and its label values in
    the catalogue's label order. Each (family, chunk) carries a version that moves whenever one of
    its series changes, so the exposition re-renders only what changed (`Exposition`)."""

    def __init__(self, expert_series_cap: int = 0):
        self._lock = threading.Lock()
        self._values: dict[str, dict[Chunk, dict[Labels, float]]] = {
            m.name: {} for m in METRICS if m.kind != "histogram"}
        self._histograms: dict[str, dict[Chunk, dict[Labels, HistogramValue]]] = {
            m.name: {} for m in METRICS if m.kind == "histogram"}
        self._versions: dict[tuple[str, Chunk], int] = {}
        self.expert_series_cap = expert_series_cap
        # Called with (name, labels, values) on every histogram observation (the OTel bridge).
        self.observers: list[Callable[[str, Labels, np.ndarray], None]] = []
        # Called after each recorded window (the exposition renders what changed, once).
        self.on_window: list[Callable[[], None]] = []

    @staticmethod
    def _check(name: str, labels: Labels) -> None:
        spec = BY_NAME.get(name)
        if spec is None:
            raise KeyError(f"{name} is not in the metric catalogue")
        if len(labels) != len(spec.labels):
            raise ValueError(f"{name}: expected labels {spec.labels}, got {labels}")

    def _bump(self, name: str, chunk: Chunk) -> None:
        self._versions[(name, chunk)] = self._versions.get((name, chunk), 0) + 1

    def _series(self, name: str, key: Labels) -> dict[Labels, float]:
        chunk = _CHUNK[name](key)
        return self._values[name].setdefault(chunk, {})

    def set(self, name: str, labels: Labels, value: float) -> None:
        self._check(name, labels)
        key, value = tuple(map(str, labels)), float(value)
        with self._lock:
            series = self._series(name, key)
            if series.get(key) != value:
                series[key] = value
                self._bump(name, _CHUNK[name](key))

    def set_many(self, name: str, items: Iterable[tuple[Labels, float]]) -> None:
        """Many series of one family at once (labels already strings): one lock, one check."""
        self._write_many(name, items, add=False)

    def inc_many(self, name: str, items: Iterable[tuple[Labels, float]]) -> None:
        """Many counters of one family at once (labels already strings)."""
        self._write_many(name, items, add=True)

    def _write_many(self, name: str, items: Iterable[tuple[Labels, float]], add: bool) -> None:
        width = len(BY_NAME[name].labels)
        chunk_of, table = _CHUNK[name], self._values[name]
        chunk, series, changed = None, None, False
        with self._lock:
            for key, value in items:
                if len(key) != width or (add and value < 0):
                    raise ValueError(f"{name}: bad {'increment' if add else 'value'} {value} for {key}")
                if chunk is None or chunk != chunk_of(key):
                    if changed:
                        self._bump(name, chunk)
                    chunk, changed = chunk_of(key), False
                    series = table.setdefault(chunk, {})
                value = float(value)
                if add:
                    series[key] = series.get(key, 0.0) + value
                    changed = True
                elif series.get(key) != value:
                    series[key] = value
                    changed = True
            if changed:
                self._bump(name, chunk)

    def remove_many(self, name: str, keys: Iterable[Labels]) -> None:
        chunk_of = _CHUNK[name]
        with self._lock:
            for key in keys:
                chunk = chunk_of(key)
                if self._values[name].get(chunk, {}).pop(key, None) is not None:
                    self._bump(name, chunk)

    def inc(self, name: str, labels: Labels, amount: float = 1.0) -> None:
        self._check(name, labels)
        if amount < 0:
            raise ValueError(f"{name}: a counter cannot decrease ({amount})")
        key = tuple(map(str, labels))
        with self._lock:
            series = self._series(name, key)
            series[key] = series.get(key, 0.0) + float(amount)
            self._bump(name, _CHUNK[name](key))

    def remove(self, name: str, labels: Labels) -> None:
        key = tuple(map(str, labels))
        chunk = _CHUNK[name](key)
        with self._lock:
            if self._values[name].get(chunk, {}).pop(key, None) is not None:
                self._bump(name, chunk)

    def remove_group(self, group: tuple[str, str]) -> None:
        """Every series of one EP group (a group the agent forgets)."""
        chunk = tuple(map(str, group))
        with self._lock:
            for name, chunks in (*self._values.items(), *self._histograms.items()):
                if chunks.pop(chunk, None) is not None:
                    self._bump(name, chunk)

    def get(self, name: str, labels: Labels, default: float | None = None) -> float | None:
        key = tuple(map(str, labels))
        with self._lock:
            return self._values[name].get(_CHUNK[name](key), {}).get(key, default)

    def observe(self, name: str, labels: Labels, values: Any) -> None:
        self._check(name, labels)
        key = tuple(map(str, labels))
        chunk = _CHUNK[name](key)
        arr = np.asarray(values, dtype=np.float64).ravel()
        with self._lock:
            hists = self._histograms[name].setdefault(chunk, {})
            hist = hists.get(key)
            if hist is None:
                hist = hists[key] = HistogramValue(BUCKETS[name])
            hist.observe(arr)
            self._bump(name, chunk)
        for observer in self.observers:
            observer(name, key, arr)

    def series(self, name: str) -> list[tuple[Labels, float]]:
        with self._lock:
            return [item for chunk in self._values[name].values() for item in chunk.items()]

    def histogram_series(self, name: str) -> list[tuple[Labels, list[tuple[str, float]], float]]:
        with self._lock:
            return [(k, h.cumulative(), h.total) for chunk in self._histograms[name].values() for k, h in chunk.items()]

    # --- for the exposition -----------------------------------------------------------------------
    def chunks(self, name: str) -> list[tuple[Chunk, int]]:
        """The family's chunks, in order, with their versions."""
        with self._lock:
            table = self._values.get(name, self._histograms.get(name))
            return [(chunk, self._versions.get((name, chunk), 0)) for chunk in table]

    def chunk_series(self, name: str, chunk: Chunk) -> list[tuple[Labels, Any]]:
        """One chunk's series: (labels, value), or for a histogram (labels, (buckets, sum))."""
        with self._lock:
            if name in self._values:
                return list(self._values[name].get(chunk, {}).items())
            return [(k, (h.cumulative(), h.total)) for k, h in self._histograms[name].get(chunk, {}).items()]

    def window_recorded(self) -> None:
        for callback in self.on_window:
            callback()


# --- what a window contributes -------------------------------------------------------------------

@dataclass
class GroupExportMemory:
    """Per-group bookkeeping the exporters need across windows."""

    verdicts: dict[int, set[tuple[str, str]]] = field(default_factory=dict)  # layer -> (verdict, cause) seen
    unhealthy_run: dict[int, int] = field(default_factory=dict)
    expert_series: set[tuple[int, int]] = field(default_factory=set)
    expert_left_out: set[tuple[int, int]] = field(default_factory=set)
    # Label tuples, built once per group and size: (L, W) -> ([L] layer keys, [L][W] rank keys).
    keys: dict[tuple[int, int], tuple[list[Labels], list[list[Labels]]]] = field(default_factory=dict)

    def labels(self, group: tuple[str, str], num_layers: int, world_size: int
               ) -> tuple[list[Labels], list[list[Labels]]]:
        found = self.keys.get((num_layers, world_size))
        if found is None:
            layers = [(*group, str(layer)) for layer in range(num_layers)]
            ranks = [[(*key, str(rank)) for rank in range(world_size)] for key in layers]
            found = self.keys[(num_layers, world_size)] = (layers, ranks)
        return found


LAYER_GAUGES = {
    "moewatch_layer_a2a_share_ratio": "a2a_share",
    "moewatch_layer_dispatch_seconds": "dispatch_seconds_per_step",
    "moewatch_layer_combine_seconds": "combine_seconds_per_step",
    "moewatch_layer_compute_seconds": "compute_seconds_per_step",
    "moewatch_layer_seconds": "layer_seconds_per_step",
    "moewatch_layer_rank_load_max_mean_ratio": "rank_load_max_mean",
    "moewatch_layer_rank_load_cv_ratio": "rank_load_cv",
    "moewatch_layer_expert_load_cv_ratio": "expert_load_cv",
    "moewatch_layer_cross_rank_ratio": "cross_rank_ratio",
    "moewatch_layer_expected_cross_rank_ratio": "expected_cross_rank_ratio",
    "moewatch_layer_cross_node_ratio": "cross_node_ratio",
    "moewatch_layer_expected_cross_node_ratio": "expected_cross_node_ratio",
    "moewatch_layer_overflow_ratio": "overflow_rate",
    "moewatch_layer_capacity_factor": "capacity_factor",
    "moewatch_layer_effective_capacity_factor": "effective_capacity_factor",
    "moewatch_layer_balancedness_ratio": "balancedness",
    "moewatch_layer_a2a_efficiency_ratio": "a2a_efficiency",
}


def record_window(state: MetricsState, memory: GroupExportMemory, w: Window, diagnosis: WindowDiagnosis,
                  expert_metrics: bool) -> None:
    """Write one accepted, triaged window into the state (the only place a window's series are set).
    The numbers are the diagnosis's and the window's shared derived quantities (computed once, by
    the triage); a family's series are written in one call. A quantity the window lacks the evidence
    for has no series (a previous window's is removed), and moewatch_layer_evidence_missing says
    which evidence was missing."""
    group = (w.model, w.ep_group)
    steps = max(w.steps, 1)
    layer_keys, rank_keys = memory.labels(group, w.num_layers, w.world_size)
    rank_load = tm.rank_load(w)
    max_min = tm.rank_load_max_min(w)
    dropless = w.capacity_factor == 0.0
    for metric, key in LAYER_GAUGES.items():
        present, absent = [], []
        for d in diagnosis.layers:
            value = d.metrics.get(key)
            if value is None or (key == "effective_capacity_factor" and dropless[d.layer]):
                absent.append(layer_keys[d.layer])  # unmeasured, or dropless: no capacity to fill
            else:
                present.append((layer_keys[d.layer], value))
        state.set_many(metric, present)
        state.remove_many(metric, absent)
    state.set_many("moewatch_layer_seconds_at_stake", [(layer_keys[d.layer], d.seconds_at_stake)
                                                       for d in diagnosis.layers if np.isfinite(d.seconds_at_stake)])
    state.set_many("moewatch_layer_evidence_missing",
                   [((*layer_keys[d.layer], kind), 1.0 if kind in d.missing else 0.0)
                    for d in diagnosis.layers for kind in tm.EVIDENCE])
    if max_min is None:
        state.remove_many("moewatch_layer_rank_load_max_min_ratio", layer_keys)
        state.remove_many("moewatch_rank_load_pairs", [k for row in rank_keys for k in row])
    else:
        # +Inf here where a rank computed nothing (None in the diagnosis's JSON).
        state.set_many("moewatch_layer_rank_load_max_min_ratio", zip(layer_keys, max_min.tolist()))
        per_step = (rank_load / steps).tolist()
        state.set_many("moewatch_rank_load_pairs", [(key, value) for keys, values in zip(rank_keys, per_step)
                                                    for key, value in zip(keys, values)])
    for metric, key in (("moewatch_layer_routed_pairs_total", "routed_pairs"),
                        ("moewatch_layer_dropped_pairs_total", "dropped_pairs"),
                        ("moewatch_layer_rerouted_pairs_total", "rerouted_pairs")):
        state.inc_many(metric, [(layer_keys[d.layer], d.metrics[key]) for d in diagnosis.layers
                                if d.metrics[key] is not None])
    # Per-expert series need per-expert counts (a window of per-rank totals has none).
    expert_load = None if w.expert_tokens is None else w.expert_tokens.astype(np.float64)
    if expert_load is not None:
        expert_mean = expert_load.mean(axis=1, keepdims=True)
        expert_share = np.divide(expert_load, expert_mean, out=np.zeros_like(expert_load), where=expert_mean > 0)
    verdicts, runs = [], []
    for d in diagnosis.layers:
        layer = layer_keys[d.layer]
        # The group's all-to-all per step: the slowest rank's (a collective ends when its last rank does).
        if d.metrics["a2a_seconds_per_step"] is not None:
            state.observe("moewatch_layer_a2a_step_seconds", layer, [d.metrics["a2a_seconds_per_step"]])
        if expert_load is not None and expert_mean[d.layer, 0] > 0:
            state.observe("moewatch_layer_expert_load_share", layer, expert_share[d.layer])
        # The verdict gauge: 1 for the current (verdict, cause), 0 for the others this layer had.
        current = (d.verdict, d.cause or "none")
        seen = memory.verdicts.setdefault(d.layer, set())
        seen.add(current)
        verdicts += [((*layer, verdict, cause), 1.0 if (verdict, cause) == current else 0.0) for verdict, cause in seen]
        run = memory.unhealthy_run.get(d.layer, 0)
        run = run + 1 if d.verdict != "healthy" else 0
        memory.unhealthy_run[d.layer] = run
        runs.append((layer, run))
    state.set_many("moewatch_layer_verdict", verdicts)
    state.set_many("moewatch_layer_unhealthy_windows", runs)
    group_ranks = [(*group, str(rank)) for rank in range(w.world_size)]
    if w.compute_seconds is None:
        state.remove_many("moewatch_rank_compute_seconds", group_ranks)
    else:
        state.set_many("moewatch_rank_compute_seconds", zip(group_ranks, (w.compute_seconds.sum(axis=0) / steps).tolist()))
    if expert_metrics and expert_load is not None:
        _record_experts(state, memory, w, group)
    state.set("moewatch_epoch", group, w.epoch)
    if w.step_seconds is not None:
        state.observe("moewatch_step_seconds", group, w.step_seconds)
    if w.step_tokens is not None:
        state.inc("moewatch_tokens_total", group, int(w.step_tokens.sum()))
    state.inc("moewatch_windows_total", group)
    state.set("moewatch_last_window_timestamp_seconds", group, w.end_time)
    _record_slo(state, group, diagnosis.summary.get("slo"))
    state.window_recorded()


_SLO_GROUP_FAMILIES = ("moewatch_slo_latency_seconds", "moewatch_slo_requests", "moewatch_slo_target_seconds",
                       "moewatch_slo_breached", "moewatch_slo_breached_seconds")


def _record_slo(state: MetricsState, group: tuple[str, str], slo: dict | None) -> None:
    """The engine's SLO signals of the window's interval (the diagnosis' `slo` section), replacing the
    previous window's; nothing when the window carries none."""
    if slo is None:
        return
    for name in _SLO_GROUP_FAMILIES:
        state.remove_many(name, [k for k, _ in state.series(name) if k[:2] == group])
    state.set_many("moewatch_slo_latency_seconds", [
        ((*group, signal, q), value) for signal, qs in slo["quantiles"].items()
        for q, value in qs.items() if value is not None])
    state.set_many("moewatch_slo_requests", [((*group, k), v) for k, v in slo["gauges"].items()])
    targets = slo["targets"]
    state.set_many("moewatch_slo_target_seconds", [((*group, "ttft_p99"), targets["ttft_p99_seconds"]),
                                                   ((*group, "tpot_p99"), targets["tpot_p99_seconds"])])
    breached = {b["slo"]: b for b in slo["breached"]}
    state.set_many("moewatch_slo_breached", [((*group, name), 1.0 if name in breached else 0.0)
                                             for name in ("ttft_p99", "tpot_p99")])
    state.set_many("moewatch_slo_breached_seconds", [((*group, name), b["breached_for_seconds"])
                                                     for name, b in breached.items()
                                                     if b["breached_for_seconds"] is not None])
    moe = slo["moe"] or {}
    for name, value in (("moewatch_slo_moe_explained", None if moe.get("explains") is None else float(moe["explains"])),
                        ("moewatch_slo_moe_share_ratio", moe.get("share_of_itl"))):
        if value is None:
            state.remove(name, group)
        else:
            state.set(name, group, value)


def _record_experts(state: MetricsState, memory: GroupExportMemory, w: Window, group: tuple[str, str]) -> None:
    cap = state.expert_series_cap
    counts = w.expert_tokens.tolist()
    items = []
    for layer in range(w.num_layers):
        for expert in range(w.num_experts):
            key = (layer, expert)
            if key not in memory.expert_series:
                if len(memory.expert_series) >= cap:
                    memory.expert_left_out.add(key)
                    continue
                memory.expert_series.add(key)
            items.append(((*group, str(layer), str(expert)), counts[layer][expert]))
    state.inc_many("moewatch_expert_pairs_total", items)
    state.set("moewatch_expert_series_dropped", group, len(memory.expert_left_out))


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
                for labels, buckets, total in self.state.histogram_series(spec.name):
                    family.add_metric(list(labels), buckets, total)
            else:
                # CounterMetricFamily takes the name without _total and adds it to the samples.
                base = spec.name[:-len("_total")] if spec.kind == "counter" else spec.name
                family = _FAMILY[spec.kind](base, spec.help, labels=list(spec.labels))
                for labels, value in self.state.series(spec.name):
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

    @staticmethod
    def _header(spec) -> bytes:
        help_text = spec.help.replace("\\", r"\\").replace("\n", r"\n")
        kind = "histogram" if spec.kind == "histogram" else spec.kind
        return f"# HELP {spec.name} {help_text}\n# TYPE {spec.name} {kind}\n".encode()

    def _label_text(self, spec, key: Labels, extra: tuple[tuple[str, str], ...] = ()) -> str:
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

    def _bucket_labels(self, spec, key: Labels, buckets: list[tuple[str, float]]) -> list[str]:
        cache_key = (spec.name + "_bucket", key)
        texts = self._buckets.get(cache_key)
        if texts is None:
            texts = self._buckets[cache_key] = [self._label_text(spec, key, (("le", le),)) for le, _ in buckets]
        return texts

    def _render_chunk(self, spec, chunk: Chunk) -> bytes:
        lines = []
        name = spec.name
        if spec.kind == "histogram":
            for key, (buckets, total) in self.state.chunk_series(name, chunk):
                for le_labels, (_, count) in zip(self._bucket_labels(spec, key, buckets), buckets):
                    lines.append(f"{name}_bucket{le_labels} {floatToGoString(count)}\n")
                labels = self._label_text(spec, key)
                lines.append(f"{name}_count{labels} {floatToGoString(buckets[-1][1])}\n")
                lines.append(f"{name}_sum{labels} {floatToGoString(total)}\n")
        else:
            for key, value in self.state.chunk_series(name, chunk):
                lines.append(f"{name}{self._label_text(spec, key)} {floatToGoString(value)}\n")
        return "".join(lines).encode()

    def render(self) -> bytes:
        with self._lock:
            out = []
            live = set()
            for spec in METRICS:
                out.append(self._headers[spec.name])
                for chunk, version in self.state.chunks(spec.name):
                    live.add((spec.name, chunk))
                    cached = self._chunks.get((spec.name, chunk))
                    if cached is None or cached[0] != version:
                        cached = (version, self._render_chunk(spec, chunk))
                        self._chunks[(spec.name, chunk)] = cached
                    out.append(cached[1])
            for gone in set(self._chunks) - live:
                del self._chunks[gone]
            return b"".join(out)


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


def init_static(state: MetricsState, mode: str) -> None:
    """Series that exist from the start: the mode and version."""
    from .config import MODES

    for m in MODES:
        state.set("moewatch_agent_mode", (m,), 1.0 if m == mode else 0.0)
    state.set("moewatch_agent_info", (__version__,), 1.0)


ACTION_KINDS = ("replicate", "placement", "capacity", "batch", "rollback")
ACTION_RESULTS = ("recommended", "applied", "skipped", "failed", "rolled_back")


def init_group(state: MetricsState, group: tuple[str, str]) -> None:
    """Counters a group's alerts take rate() of start at 0, so the first event is an increase."""
    for kind in ACTION_KINDS:
        for result in ACTION_RESULTS:
            state.inc("moewatch_actions_total", (*group, kind, result), 0)
    for name in ("moewatch_rollbacks_total", "moewatch_runtime_frames_dropped_total", "moewatch_windows_total",
                 "moewatch_tokens_total"):
        state.inc(name, group, 0)


def init_jobs(state: MetricsState, jobs: list[str]) -> None:
    for job in jobs:
        state.inc("moewatch_job_errors_total", (job,), 0)
        state.inc("moewatch_job_misfires_total", (job,), 0)


def family_names(exposition: str) -> set[str]:
    """Metric family names declared (# TYPE) in a text exposition."""
    return {line.split()[2] for line in exposition.splitlines() if line.startswith("# TYPE ")}


def sample_names(exposition: str) -> Iterable[str]:
    for line in exposition.splitlines():
        if line and not line.startswith("#"):
            yield line.split("{", 1)[0].split(" ", 1)[0]
