"""Prometheus export: the agent's metric state and one collector that renders it.

`MetricsState` holds every series the agent exports, keyed by the catalogue's names (agent/catalog.py):
gauges and counters as values, histograms as bucket counts. The jobs write it (a window's numbers are
computed once, by the triage job, in `record_window`); a scrape only copies it out (`AgentCollector`),
and the OpenTelemetry bridge (agent/otel.py) reads the same state. A name or label set outside the
catalogue is a programming error and raises, so nothing outside the contract can leak into /metrics.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np
from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

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
        cum = np.cumsum(self.counts)
        return [(_bound_text(b), float(c)) for b, c in zip(self.bounds, cum[:-1])] + [("+Inf", float(cum[-1]))]


def _bound_text(bound: float) -> str:
    return repr(float(bound))


class MetricsState:
    """Every exported series. Thread-safe. Writers name a catalogue metric and its label values in
    the catalogue's label order."""

    def __init__(self, expert_series_cap: int = 0):
        self._lock = threading.Lock()
        self.values: dict[str, dict[Labels, float]] = {m.name: {} for m in METRICS if m.kind != "histogram"}
        self.histograms: dict[str, dict[Labels, HistogramValue]] = {
            m.name: {} for m in METRICS if m.kind == "histogram"}
        self.expert_series_cap = expert_series_cap
        # Called with (name, labels, values) on every histogram observation (the OTel bridge).
        self.observers: list[Callable[[str, Labels, np.ndarray], None]] = []

    @staticmethod
    def _check(name: str, labels: Labels) -> None:
        spec = BY_NAME.get(name)
        if spec is None:
            raise KeyError(f"{name} is not in the metric catalogue")
        if len(labels) != len(spec.labels):
            raise ValueError(f"{name}: expected labels {spec.labels}, got {labels}")

    def set(self, name: str, labels: Labels, value: float) -> None:
        self._check(name, labels)
        with self._lock:
            self.values[name][tuple(map(str, labels))] = float(value)

    def inc(self, name: str, labels: Labels, amount: float = 1.0) -> None:
        self._check(name, labels)
        if amount < 0:
            raise ValueError(f"{name}: a counter cannot decrease ({amount})")
        key = tuple(map(str, labels))
        with self._lock:
            series = self.values[name]
            series[key] = series.get(key, 0.0) + float(amount)

    def remove(self, name: str, labels: Labels) -> None:
        with self._lock:
            self.values[name].pop(tuple(map(str, labels)), None)

    def get(self, name: str, labels: Labels, default: float | None = None) -> float | None:
        with self._lock:
            return self.values[name].get(tuple(map(str, labels)), default)

    def observe(self, name: str, labels: Labels, values: Any) -> None:
        self._check(name, labels)
        key = tuple(map(str, labels))
        arr = np.asarray(values, dtype=np.float64).ravel()
        with self._lock:
            hist = self.histograms[name].get(key)
            if hist is None:
                hist = self.histograms[name][key] = HistogramValue(BUCKETS[name])
            hist.observe(arr)
        for observer in self.observers:
            observer(name, key, arr)

    def series(self, name: str) -> list[tuple[Labels, float]]:
        with self._lock:
            return list(self.values[name].items())

    def histogram_series(self, name: str) -> list[tuple[Labels, list[tuple[str, float]], float]]:
        with self._lock:
            return [(k, h.cumulative(), h.total) for k, h in self.histograms[name].items()]


# --- what a window contributes -------------------------------------------------------------------

@dataclass
class GroupExportMemory:
    """Per-group bookkeeping the exporters need across windows."""

    verdicts: dict[int, set[tuple[str, str]]] = field(default_factory=dict)  # layer -> (verdict, cause) seen
    unhealthy_run: dict[int, int] = field(default_factory=dict)
    expert_series: set[tuple[int, int]] = field(default_factory=set)
    expert_left_out: set[tuple[int, int]] = field(default_factory=set)


def record_window(state: MetricsState, memory: GroupExportMemory, w: Window, diagnosis: WindowDiagnosis,
                  expert_metrics: bool) -> None:
    """Write one accepted, triaged window into the state (the only place a window's series are set).
    A quantity the window lacks the evidence for has no series (a previous window's is removed), and
    moewatch_layer_evidence_missing says which evidence was missing."""
    group = (w.model, w.ep_group)
    steps = max(w.steps, 1)
    rank_load = tm.rank_load(w)
    max_min = tm.rank_load_max_min(w)
    layer_gauges = {
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
        "moewatch_layer_overflow_ratio": "overflow_rate",
        "moewatch_layer_capacity_factor": "capacity_factor",
        "moewatch_layer_effective_capacity_factor": "effective_capacity_factor",
        "moewatch_layer_balancedness_ratio": "balancedness",
        "moewatch_layer_a2a_efficiency_ratio": "a2a_efficiency",
    }
    for d in diagnosis.layers:
        layer = (*group, str(d.layer))
        m = d.metrics
        for metric, key in layer_gauges.items():
            value = m.get(key)
            if key == "effective_capacity_factor" and float(w.capacity_factor[d.layer]) == 0.0:
                value = None  # dropless: no capacity to fill
            if value is None:
                state.remove(metric, layer)
            else:
                state.set(metric, layer, value)
        for kind in tm.EVIDENCE:
            state.set("moewatch_layer_evidence_missing", (*layer, kind), 1.0 if kind in d.missing else 0.0)
        if max_min is None:
            state.remove("moewatch_layer_rank_load_max_min_ratio", layer)
        else:
            # None in the diagnosis means +Inf here (a rank that computed nothing).
            state.set("moewatch_layer_rank_load_max_min_ratio", layer, float(max_min[d.layer]))
        # The group's all-to-all per step: the slowest rank's (a collective ends when its last rank does).
        if m["a2a_seconds_per_step"] is not None:
            state.observe("moewatch_layer_a2a_step_seconds", layer, [m["a2a_seconds_per_step"]])
        state.inc("moewatch_layer_routed_pairs_total", layer, m["routed_pairs"])
        if m["dropped_pairs"] is not None:
            state.inc("moewatch_layer_dropped_pairs_total", layer, m["dropped_pairs"])
        if m["rerouted_pairs"] is not None:
            state.inc("moewatch_layer_rerouted_pairs_total", layer, m["rerouted_pairs"])
        expert_load = w.expert_tokens[d.layer].astype(np.float64)
        if expert_load.sum() > 0:
            state.observe("moewatch_layer_expert_load_share", layer, expert_load / expert_load.mean())
        # The verdict gauge: 1 for the current (verdict, cause), 0 for the others this layer had.
        current = (d.verdict, d.cause or "none")
        seen = memory.verdicts.setdefault(d.layer, set())
        seen.add(current)
        for verdict, cause in seen:
            state.set("moewatch_layer_verdict", (*layer, verdict, cause), 1.0 if (verdict, cause) == current else 0.0)
        run = memory.unhealthy_run.get(d.layer, 0)
        run = run + 1 if d.verdict != "healthy" else 0
        memory.unhealthy_run[d.layer] = run
        state.set("moewatch_layer_unhealthy_windows", layer, run)
        for rank in range(w.world_size):
            if rank_load is None:
                state.remove("moewatch_rank_load_pairs", (*layer, str(rank)))
            else:
                state.set("moewatch_rank_load_pairs", (*layer, str(rank)), rank_load[d.layer, rank] / steps)
    for rank in range(w.world_size):
        if w.compute_seconds is None:
            state.remove("moewatch_rank_compute_seconds", (*group, str(rank)))
        else:
            state.set("moewatch_rank_compute_seconds", (*group, str(rank)), w.compute_seconds[:, rank].sum() / steps)
    if expert_metrics:
        _record_experts(state, memory, w, group)
    state.set("moewatch_epoch", group, w.epoch)
    if w.step_seconds is not None:
        state.observe("moewatch_step_seconds", group, w.step_seconds)
    if w.step_tokens is not None:
        state.inc("moewatch_tokens_total", group, int(w.step_tokens.sum()))
    state.inc("moewatch_windows_total", group)
    state.set("moewatch_last_window_timestamp_seconds", group, w.end_time)


def _record_experts(state: MetricsState, memory: GroupExportMemory, w: Window, group: tuple[str, str]) -> None:
    cap = state.expert_series_cap
    for layer in range(w.num_layers):
        for expert in range(w.num_experts):
            key = (layer, expert)
            if key not in memory.expert_series:
                if len(memory.expert_series) >= cap:
                    memory.expert_left_out.add(key)
                    continue
                memory.expert_series.add(key)
            state.inc("moewatch_expert_pairs_total", (*group, str(layer), str(expert)),
                      int(w.expert_tokens[layer, expert]))
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


def make_registry(state: MetricsState) -> CollectorRegistry:
    """A registry holding only the agent's collector: nothing outside the catalogue is exported."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(state))
    return registry


def render(registry: CollectorRegistry) -> bytes:
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
