"""Where every exported series lives: `MetricsState`, written through the families that own them.

A writer binds a family to the state and writes it: `state[ACTIONS_TOTAL].inc(labels, n)`. Gauges
and counters are stored as values, histograms as bucket counts, per (family, chunk): the series of
one EP group form one chunk of their family, and each chunk carries a version that moves whenever
one of its series changes, so the exposition (agent/exporters.py) re-renders only what changed and
a scrape copies bytes. The OpenTelemetry bridge (agent/otel.py) reads the same state. Storage knows
nothing of presentation: it imports no exporter.
"""

from __future__ import annotations

import functools
import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence, Union

import numpy as np

from .family import Family, Histogram, Labels

Chunk = tuple[str, ...]
FamilyRef = Union[Family, str]  # a family, or (for readers and the transition) its exposed name
_GROUP_OF = operator.itemgetter(0, 1)  # a per-group series' chunk: its (model, ep_group)


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
        return list(zip(bound_texts(self.bounds), cum))


@functools.lru_cache(maxsize=None)
def bound_texts(bounds: tuple[float, ...]) -> tuple[str, ...]:
    """The `le` label values of a histogram's buckets, +Inf last."""
    return (*(repr(float(b)) for b in bounds), "+Inf")


def _catalogued(name: str) -> Family:
    from ..catalog import BY_NAME  # the catalogue imports every concern; looked up only for names

    family = BY_NAME.get(name)
    if family is None:
        raise KeyError(f"{name} is not in the metric catalogue")
    return family


class MetricsState:
    """Every exported series. Thread-safe. `state[family]` is the family's writer (`FamilyWriter`);
    label values are given in the family's label order."""

    def __init__(self, expert_series_cap: int = 0):
        self._lock = threading.Lock()
        self._values: dict[str, dict[Chunk, dict[Labels, float]]] = {}
        self._histograms: dict[str, dict[Chunk, dict[Labels, HistogramValue]]] = {}
        self._versions: dict[tuple[str, Chunk], int] = {}
        self.generation = 0  # moves with every chunk's version: nothing changed while it stays
        self._writers: dict[Family, FamilyWriter] = {}
        self.expert_series_cap = expert_series_cap
        # Called with (name, labels, values) on every histogram observation (the OTel bridge).
        self.observers: list[Callable[[str, Labels, np.ndarray], None]] = []
        # Called after each recorded window (the exposition renders what changed, once).
        self.on_window: list[Callable[[], None]] = []

    def __getitem__(self, family: FamilyRef) -> FamilyWriter:
        if isinstance(family, str):
            family = _catalogued(family)
        writer = self._writers.get(family)
        if writer is None:
            with self._lock:
                table = self._histograms if isinstance(family, Histogram) else self._values
                table.setdefault(family.name, {})
                writer = self._writers.setdefault(family, FamilyWriter(self, family))
        return writer

    # --- by name: the readers' way (tests, /status), and the writers' during a transition ---------
    def inc(self, family: FamilyRef, labels: Labels, amount: float = 1.0) -> None:
        self[family].inc(labels, amount)

    def set(self, family: FamilyRef, labels: Labels, value: float) -> None:
        self[family].set(labels, value)

    def get(self, family: FamilyRef, labels: Labels, default: float | None = None) -> float | None:
        return self[family].get(labels, default)

    def series(self, family: FamilyRef) -> list[tuple[Labels, float]]:
        name = family if isinstance(family, str) else family.name
        with self._lock:
            return [item for chunk in self._values.get(name, {}).values() for item in chunk.items()]

    def histogram_series(self, family: FamilyRef) -> list[tuple[Labels, list[tuple[str, float]], float]]:
        name = family if isinstance(family, str) else family.name
        with self._lock:
            return [(k, h.cumulative(), h.total) for chunk in self._histograms.get(name, {}).values()
                    for k, h in chunk.items()]

    def remove_group(self, group: tuple[str, str]) -> None:
        """Every series of one EP group (a group the agent forgets)."""
        chunk = tuple(map(str, group))
        with self._lock:
            for name, chunks in (*self._values.items(), *self._histograms.items()):
                if chunks.pop(chunk, None) is not None:
                    self._bump(name, chunk)

    def _bump(self, name: str, chunk: Chunk) -> None:
        self._versions[(name, chunk)] = self._versions.get((name, chunk), 0) + 1
        self.generation += 1

    # --- for the exposition -----------------------------------------------------------------------
    def chunks(self, family: Family) -> list[tuple[Chunk, int]]:
        """The family's chunks, in order, with their versions."""
        with self._lock:
            table = self._histograms if isinstance(family, Histogram) else self._values
            return [(chunk, self._versions.get((family.name, chunk), 0)) for chunk in table.get(family.name, {})]

    def chunk_series(self, family: Family, chunk: Chunk) -> list[tuple[Labels, Any]]:
        """One chunk's series: (labels, value), or for a histogram (labels, (buckets, sum))."""
        with self._lock:
            if not isinstance(family, Histogram):
                return list(self._values.get(family.name, {}).get(chunk, {}).items())
            return [(k, (h.cumulative(), h.total)) for k, h in self._histograms.get(family.name, {})
                    .get(chunk, {}).items()]

    def chunk_columns(self, family: Family, chunk: Chunk) -> tuple[list[Labels], list[float]]:
        """One chunk's gauge or counter series as two lists: label tuples and values, in order."""
        with self._lock:
            series = self._values.get(family.name, {}).get(chunk, {})
            return list(series), list(series.values())

    def window_recorded(self) -> None:
        for callback in self.on_window:
            callback()


class FamilyWriter:
    """One family's series in one state. Label values are converted to strings; the `_many` forms
    take label tuples that are strings already (built once per group, GroupExportMemory.labels)."""

    def __init__(self, state: MetricsState, family: Family):
        self.state = state
        self.family = family
        self.name = family.name
        self._width = len(family.labels)
        self._chunk_of: Callable[[Labels], Chunk] = (lambda key: key[:2]) if family.per_group else (lambda key: ())
        store = state._histograms if isinstance(family, Histogram) else state._values
        self._table: dict[Chunk, dict] = store[family.name]

    def _key(self, labels: Labels) -> Labels:
        if len(labels) != self._width:
            raise ValueError(f"{self.name}: expected labels {self.family.labels}, got {labels}")
        return tuple(map(str, labels))

    def set(self, labels: Labels, value: float) -> None:
        self._expect("gauge")
        key, value = self._key(labels), float(value)
        chunk = self._chunk_of(key)
        with self.state._lock:
            series = self._table.setdefault(chunk, {})
            if series.get(key) != value:
                series[key] = value
                self.state._bump(self.name, chunk)

    def inc(self, labels: Labels, amount: float = 1.0) -> None:
        self._expect("counter")
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot decrease ({amount})")
        key = self._key(labels)
        chunk = self._chunk_of(key)
        with self.state._lock:
            series = self._table.setdefault(chunk, {})
            series[key] = series.get(key, 0.0) + float(amount)
            self.state._bump(self.name, chunk)

    def set_many(self, items: Iterable[tuple[Labels, float]], chunk: Chunk | None = None) -> None:
        """Many series at once: one lock. `chunk`: every key is of this one chunk (a window's series of
        its own group), so the keys are stored in one pass."""
        self._expect("gauge")
        self._write_many(items, add=False, chunk=chunk)

    def inc_many(self, items: Iterable[tuple[Labels, float]], chunk: Chunk | None = None) -> None:
        self._expect("counter")
        self._write_many(items, add=True, chunk=chunk)

    def set_columns(self, keys: list[Labels], values: list[float], chunk: Chunk) -> None:
        """`set_many(zip(keys, values), chunk)` without building the pairs: a window's thousands of
        layer x rank series come as one list of label tuples (built once per group) and one of values."""
        self._expect("gauge")
        if len(keys) != len(values):
            raise ValueError(f"{self.name}: {len(keys)} label tuples for {len(values)} values")
        if keys:
            self._write_chunk(chunk, keys, values, add=False)

    def _write_many(self, items: Iterable[tuple[Labels, float]], add: bool, chunk: Chunk | None) -> None:
        if chunk is None:
            for one_chunk, chunk_items in self._by_chunk(items):
                self._write_items(one_chunk, chunk_items, add)
        else:
            self._write_items(chunk, list(items), add)

    def _by_chunk(self, items: Iterable[tuple[Labels, float]]) -> list[tuple[Chunk, list]]:
        """Items split into runs of one chunk each, in order."""
        runs: list[tuple[Chunk, list]] = []
        for item in items:
            chunk = self._chunk_of(item[0])
            if not runs or runs[-1][0] != chunk:
                runs.append((chunk, []))
            runs[-1][1].append(item)
        return runs

    def _write_items(self, chunk: Chunk, items: list[tuple[Labels, float]], add: bool) -> None:
        if items:
            keys, raw = zip(*items)
            self._write_chunk(chunk, keys, raw, add)

    def _write_chunk(self, chunk: Chunk, keys: Sequence[Labels], raw: Sequence[float], add: bool) -> None:
        values = list(map(float, raw))
        if set(map(len, keys)) != {self._width} or (add and min(values) < 0):
            bad = next((k, v) for k, v in zip(keys, values) if len(k) != self._width or (add and v < 0))
            raise ValueError(f"{self.name}: bad {'increment' if add else 'value'} {bad[1]} for {bad[0]}")
        if self.family.per_group and set(map(_GROUP_OF, keys)) != {chunk}:
            raise ValueError(f"{self.name}: a key outside chunk {chunk}")
        with self.state._lock:
            series = self._table.setdefault(chunk, {})
            if add:
                get = series.get
                series.update(zip(keys, [get(key, 0.0) + value for key, value in zip(keys, values)]))
            elif any(map(operator.ne, map(series.get, keys), values)):
                series.update(zip(keys, values))
            else:
                return
            self.state._bump(self.name, chunk)

    def remove(self, labels: Labels) -> None:
        self.remove_many([tuple(map(str, labels))])

    def remove_many(self, keys: Iterable[Labels]) -> None:
        with self.state._lock:
            for key in keys:
                chunk = self._chunk_of(key)
                if self._table.get(chunk, {}).pop(key, None) is not None:
                    self.state._bump(self.name, chunk)

    def get(self, labels: Labels, default: float | None = None) -> float | None:
        key = tuple(map(str, labels))
        with self.state._lock:
            return self._table.get(self._chunk_of(key), {}).get(key, default)

    def observe(self, labels: Labels, values: Any) -> None:
        self._expect("histogram")
        key = self._key(labels)
        chunk = self._chunk_of(key)
        arr = np.asarray(values, dtype=np.float64).ravel()
        with self.state._lock:
            hists = self._table.setdefault(chunk, {})
            hist = hists.get(key)
            if hist is None:
                hist = hists[key] = HistogramValue(self.family.buckets)
            hist.observe(arr)
            self.state._bump(self.name, chunk)
        for observer in self.state.observers:
            observer(self.name, key, arr)

    def observe_rows(self, keys: list[Labels], rows: np.ndarray) -> None:
        """One observation batch per series: rows[i] ([n_i] values, or [S, n] as one array) goes to
        keys[i]. Equal to `observe(keys[i], rows[i])` for each i, with one bucket search for all."""
        self._expect("histogram")
        if not keys:
            return
        rows = np.asarray(rows, dtype=np.float64).reshape(len(keys), -1)
        bounds = self.family.buckets
        nb = len(bounds) + 1
        finite = np.isfinite(rows)
        idx = np.searchsorted(np.asarray(bounds), np.where(finite, rows, 0.0), side="left")
        series_of = np.broadcast_to(np.arange(len(keys))[:, None], rows.shape)
        counts = np.bincount((series_of * nb + idx)[finite], minlength=len(keys) * nb).reshape(len(keys), nb)
        totals = rows.sum(axis=1).tolist()
        for i in np.flatnonzero(~finite.all(axis=1)).tolist():  # as observe() sums: the finite values only
            totals[i] = float(rows[i][finite[i]].sum())
        sizes = finite.sum(axis=1).tolist()
        with self.state._lock:
            touched = set()
            for i, key in enumerate(keys):
                chunk = self._chunk_of(key)
                hists = self._table.setdefault(chunk, {})
                hist = hists.get(key)
                if hist is None:
                    hist = hists[key] = HistogramValue(bounds)
                if sizes[i]:
                    hist.counts += counts[i]
                    hist.total += totals[i]
                    hist.count += sizes[i]
                touched.add(chunk)
            for chunk in touched:
                self.state._bump(self.name, chunk)
        for observer in self.state.observers:
            for key, row in zip(keys, rows):
                observer(self.name, key, row)

    def _expect(self, kind: str) -> None:
        if self.family.kind != kind:
            raise TypeError(f"{self.name} is a {self.family.kind}, not a {kind}")
