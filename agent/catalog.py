"""Every metric the agent exports, in exposition order: the one list of the metric families.

Each family is declared by the concern that writes it (agent/metrics/: connections, actions, rank_speed,
groups, windows, jobs, identity) with its name, type, labels, unit and meaning, and checked there
against the naming conventions when it is declared. This module lists them all: the Prometheus
exposition and the OpenTelemetry instruments are built from this list; the alert rules
(alerts/*.yml) and dashboards (dashboards/generate.py --check) are checked against it, and a test
checks the live /metrics output against it. Names follow Prometheus conventions ([prometheus],
docs/sources.md): `moewatch_` prefix, base units (`_seconds`, `_bytes`, `_ratio` for 0-1 shares), counters end in `_total`.
A name here is a contract with operators' alerts and dashboards: add freely, never rename.

Per-layer series are aggregates (one per layer, or layer x rank); per-expert series exist only when
the operator enables them, under a cap ([measured-cardinality], docs/sources.md: 61 x 256 experts is 15,616 series per model).
"""

from __future__ import annotations

import importlib
import pkgutil

from . import metrics as _metrics
from .metrics import actions, connections, groups, identity, jobs
from .metrics import engine_rebalance as er
from .metrics import ledger
from .metrics import rank_speed as rs
from .metrics import rebalance_watchdog as rw
from .metrics import shards
from .metrics import slo
from .metrics import windows as w
from .metrics.family import GROUP, LAYER, Counter, Family, Gauge, Histogram  # noqa: F401  (re-exported)
from .metrics.windows import A2A_STEP_BUCKETS, EXPERT_LOAD_SHARE_BUCKETS, STEP_BUCKETS  # noqa: F401

_KINDS = {"counter": Counter, "gauge": Gauge}


def MetricSpec(name: str, kind: str, labels: tuple[str, ...], help: str, unit: str = "") -> Family:  # noqa: N802
    """A family from the former (name, kind, labels, help) form, so a catalogue entry written that way
    still declares a checked family. New families are declared in their concern's module."""
    if kind == "histogram":
        raise ValueError(f"{name}: declare a histogram with its buckets in its concern's module")
    return _KINDS[kind](name, labels, help, unit=unit)


METRICS: tuple[Family, ...] = (
    # --- per layer, from the latest window (gauges) and accumulated over windows (counters)
    w.LAYER_A2A_SHARE, w.LAYER_A2A_TRANSFER_SHARE, w.LAYER_A2A_WAIT_SHARE, w.LAYER_TIME_BALANCEDNESS,
    w.LAYER_DISPATCH, w.LAYER_COMBINE, w.LAYER_COMPUTE, w.LAYER_TIME, w.LAYER_A2A_STEP,
    w.LAYER_RANK_LOAD_MAX_MEAN, w.LAYER_RANK_LOAD_MAX_MIN, w.LAYER_RANK_LOAD_CV, w.LAYER_EXPERT_LOAD_CV,
    w.LAYER_CROSS_RANK, w.LAYER_CROSS_NODE, w.LAYER_EXPECTED_CROSS_NODE, w.LAYER_SECONDS_AT_STAKE,
    w.LAYER_EXPECTED_CROSS_RANK, w.LAYER_OVERFLOW, w.LAYER_ROUTED_PAIRS_TOTAL, w.LAYER_DROPPED_PAIRS_TOTAL,
    w.LAYER_REROUTED_PAIRS_TOTAL, w.LAYER_CAPACITY_FACTOR, w.LAYER_EFFECTIVE_CAPACITY_FACTOR, w.LAYER_BALANCEDNESS,
    w.LAYER_A2A_EFFICIENCY, w.LAYER_VERDICT, w.LAYER_EVIDENCE_MISSING, w.LAYER_EXPERT_LOAD_SHARE,
    # --- per rank
    w.RANK_LOAD_PAIRS, w.RANK_COMPUTE, rs.RANK_RELATIVE_SPEED, rs.RANK_SLOW,
    # --- per expert, only when enabled, capped
    w.EXPERT_PAIRS_TOTAL, w.EXPERT_SERIES_DROPPED,
    # --- per EP group
    w.EPOCH, w.STEP_TIME, w.TOKENS_TOTAL, w.WINDOWS_TOTAL, w.LAST_WINDOW_TIMESTAMP,
    groups.RUNTIME_CONNECTED, groups.RUNTIME_FRAMES_DROPPED_TOTAL, groups.RUNTIME_WINDOWS_LOST_TOTAL,
    actions.ACTIONS_TOTAL, actions.ROLLBACKS_TOTAL,
    er.CALLS_TOTAL, er.LAYERS_TOTAL, er.EXPERTS_MOVED_TOTAL, er.BALANCEDNESS, er.PREDICTED_STALL, er.SOLVE_SECONDS,
    er.VERDICTS_TOTAL, er.LAYERS_WORSE_TOTAL,
    rw.INTERVAL_STEPS, rw.ASYNCHRONOUS, rw.STEPS_SINCE, rw.OVERDUE, rw.STEP_STALL,
    ledger.ENTRIES_TOTAL, ledger.STALL, ledger.STALL_TOTAL, ledger.GAIN_PER_STEP, ledger.NET, ledger.BREAK_EVEN_STEPS,
    ledger.HORIZON_STEPS, ledger.BALANCEDNESS, ledger.STEP_SECONDS, ledger.LAST_TIMESTAMP,
    w.LAYER_UNHEALTHY_WINDOWS,
    # --- per sharded EP group, the shard merge
    shards.SHARD_WINDOWS_TOTAL, shards.SHARDS_MISSING_TOTAL, shards.SHARDS_REFUSED_TOTAL,
    shards.SHARD_SEQUENCES_PENDING, shards.DIGEST_MISMATCHES_TOTAL,
    # --- per EP group, the engine's own SLO signals over the latest scrape interval (slo: section)
    slo.LATENCY, slo.REQUESTS, slo.TARGET, slo.BREACHED, slo.BREACHED_SECONDS, slo.MOE_EXPLAINED, slo.MOE_SHARE,
    # --- the agent itself
    connections.FRAMES_RECEIVED_TOTAL, connections.FRAMES_REJECTED_TOTAL, connections.CONNECTIONS_REFUSED_TOTAL,
    connections.CONNECTIONS_CLOSED_TOTAL, groups.GROUPS_RETIRED_TOTAL, groups.GROUPS_EVICTED_TOTAL,
    jobs.JOB_ERRORS_TOTAL, jobs.JOB_MISFIRES_TOTAL,
    identity.AGENT_MODE, identity.AGENT_INFO,
)

# Every module of agent/metrics that declares families: a new concern is checked without being named here.
CONCERNS = tuple(module for module in (importlib.import_module(f"{_metrics.__name__}.{info.name}")
                                       for info in pkgutil.iter_modules(_metrics.__path__))
                 if hasattr(module, "FAMILIES"))


def _check_catalogue() -> None:
    """Every family a concern declares is listed once, and no two families share a name."""
    names = [m.name for m in METRICS]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"metric families listed twice: {repeated}")
    declared = {f for concern in CONCERNS for f in concern.FAMILIES}
    unlisted = sorted(f.name for f in declared - set(METRICS))
    if unlisted:
        raise ValueError(f"metric families declared but not in the catalogue: {unlisted}")


_check_catalogue()

BY_NAME = {m.name: m for m in METRICS}
BUCKETS = {m.name: m.buckets for m in METRICS if isinstance(m, Histogram)}


def exposed_names() -> set[str]:
    """Every series name a scrape can show, histograms expanded to _bucket/_sum/_count."""
    return {name for m in METRICS for name in m.exposed_names()}
