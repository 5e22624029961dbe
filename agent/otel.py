"""The same quantities as /metrics, as OpenTelemetry metrics through the SDK.

Every catalogue metric becomes one instrument: gauges are observable gauges and counters observable
counters, both read from `MetricsState` when the SDK collects (so the numbers are exactly the ones
Prometheus sees); histograms are SDK histograms fed by the state's observation hook, with the
catalogue's bucket bounds. Instrument names are the catalogue's, counters without `_total` (an OTLP
-> Prometheus pipeline adds it back). With an endpoint configured, a periodic reader pushes over
OTLP/HTTP; tests pass an `InMemoryMetricReader` instead.
"""

from __future__ import annotations

import logging
from typing import Iterable

import numpy as np
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource

from moewatch import __version__

from .catalog import BUCKETS, METRICS
from .metrics.family import Family, Labels
from .metrics.state import MetricsState

log = logging.getLogger("moewatch.agent.otel")


def instrument_name(spec: Family) -> str:
    return spec.name[:-len("_total")] if spec.kind == "counter" else spec.name


def unit_of(spec: Family) -> str:
    """The OpenTelemetry unit (UCUM) of a family's declared unit."""
    return {"seconds": "s", "bytes": "By"}.get(spec.unit, "1")


class OtelBridge:
    """Owns a MeterProvider whose instruments mirror the catalogue."""

    def __init__(self, state: MetricsState, endpoint: str = "", interval_seconds: float = 15.0,
                 readers: Iterable[MetricReader] = ()):
        self.state = state
        readers = list(readers)
        if endpoint:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint),
                                                         export_interval_millis=interval_seconds * 1000))
        views = [View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(list(bounds)))
                 for name, bounds in BUCKETS.items()]
        self.provider = MeterProvider(metric_readers=readers, views=views,
                                      resource=Resource.create({"service.name": "moewatch-agent",
                                                                "service.version": __version__}))
        meter = self.provider.get_meter("moewatch.agent", __version__)
        self._histograms = {}
        for spec in METRICS:
            name = instrument_name(spec)
            if spec.kind == "gauge":
                meter.create_observable_gauge(name, callbacks=[self._reader(spec)], unit=unit_of(spec),
                                              description=spec.help)
            elif spec.kind == "counter":
                meter.create_observable_counter(name, callbacks=[self._reader(spec)], unit=unit_of(spec),
                                                description=spec.help)
            else:
                self._histograms[spec.name] = (spec, meter.create_histogram(name, unit=unit_of(spec),
                                                                            description=spec.help))
        state.observers.append(self._observe)

    def _reader(self, spec: Family):
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            for labels, value in self.state.series(spec):
                yield Observation(value, dict(zip(spec.labels, labels)))
        return callback

    def _observe(self, name: str, labels: Labels, values: np.ndarray) -> None:
        spec, histogram = self._histograms[name]
        attributes = dict(zip(spec.labels, labels))
        for value in values[np.isfinite(values)]:
            histogram.record(float(value), attributes)

    def shutdown(self) -> None:
        try:
            self.state.observers.remove(self._observe)
        except ValueError:
            pass
        try:
            # A collector that is down must not hold the agent's shutdown for the exporter's full retry.
            self.provider.shutdown(timeout_millis=3000)
        except Exception as exc:  # a push that fails at exit must not stop the shutdown
            log.warning("OpenTelemetry shutdown: %s", exc)
