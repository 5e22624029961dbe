"""Families of the engine's own SLO signals over the latest scrape interval (the `slo:` section):
latency percentiles, requests, targets and breaches, as soon as the SLO source has the interval
(`record_annotations`) and again from each window's diagnosis (its `slo` summary, `record_slo`),
which adds whether the MoE evidence explains a breach."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moewatch.slo import SLO_KEY
from moewatch.slo import section as slo_section

from .family import GROUP, Gauge, families_of

if TYPE_CHECKING:
    from .state import MetricsState

LATENCY = Gauge(
    "moewatch_slo_latency_seconds", (*GROUP, "signal", "percentile"),
    "The engine's latency percentile over the latest scrape interval, from its histogram buckets "
    "(signal: ttft, itl, tpot, e2e, queue; percentile: p50, p90, p99).", unit="seconds")
REQUESTS = Gauge("moewatch_slo_requests", (*GROUP, "state"),
                 "The engine's requests by state (running, waiting) at the latest scrape.")
TARGET = Gauge("moewatch_slo_target_seconds", (*GROUP, "slo"),
               "The SLO target the agent judges by (ttft_p99, tpot_p99).", unit="seconds")
BREACHED = Gauge("moewatch_slo_breached", (*GROUP, "slo"),
                 "1 while the SLO (ttft_p99, tpot_p99) is over its target, 0 while met.")
BREACHED_SECONDS = Gauge("moewatch_slo_breached_seconds", (*GROUP, "slo"),
                         "How long the SLO has been over its target (absent while met).", unit="seconds")
MOE_EXPLAINED = Gauge(
    "moewatch_slo_moe_explained", GROUP,
    "While an SLO is breached: 1 when the unhealthy MoE layers' seconds at stake explain it, 0 when the "
    "cause is elsewhere (absent when unknown or nothing is breached).")
MOE_SHARE = Gauge(
    "moewatch_slo_moe_share_ratio", GROUP,
    "While an SLO is breached: the unhealthy MoE layers' seconds at stake per step over the inter-token "
    "latency p99.", unit="ratio")

FAMILIES = families_of(globals())
SLOS = ("ttft_p99", "tpot_p99")


def record_slo(state: MetricsState, group: tuple[str, str], slo: dict | None) -> None:
    """The engine's SLO signals of the window's interval (the diagnosis' `slo` section), replacing the
    previous window's, with whether the window's MoE evidence explains a breach; nothing when the
    window carries none."""
    if slo is None:
        return
    _record_interval(state, group, slo)
    moe = slo["moe"] or {}
    explains = moe.get("explains")
    for family, value in ((MOE_EXPLAINED, None if explains is None else float(explains)),
                          (MOE_SHARE, moe.get("share_of_itl"))):
        if value is None:
            state[family].remove(group)
        else:
            state[family].set(group, value)


def record_annotations(state: MetricsState, group: tuple[str, str], extra: dict[str, Any]) -> None:
    """What a source stamps on the group's windows (`extra`), exported as soon as the source has it:
    the SLO interval's percentiles, requests, targets and breaches (the MoE attribution needs a
    window's layers, so it waits for one). Nothing for entries that are not SLO signals."""
    section = slo_section(extra.get(SLO_KEY), ())
    if section is not None:
        _record_interval(state, group, section)


def _record_interval(state: MetricsState, group: tuple[str, str], slo: dict) -> None:
    for family in (LATENCY, REQUESTS, TARGET, BREACHED, BREACHED_SECONDS):
        state[family].remove_many([k for k, _ in state.series(family) if k[:2] == group])
    state[LATENCY].set_many([((*group, signal, q), value) for signal, qs in slo["quantiles"].items()
                             for q, value in qs.items() if value is not None])
    state[REQUESTS].set_many([((*group, k), v) for k, v in slo["gauges"].items()])
    targets = slo["targets"]
    state[TARGET].set_many([((*group, "ttft_p99"), targets["ttft_p99_seconds"]),
                            ((*group, "tpot_p99"), targets["tpot_p99_seconds"])])
    breached = {b["slo"]: b for b in slo["breached"]}
    state[BREACHED].set_many([((*group, name), 1.0 if name in breached else 0.0) for name in SLOS])
    state[BREACHED_SECONDS].set_many([((*group, name), b["breached_for_seconds"]) for name, b in breached.items()
                                      if b["breached_for_seconds"] is not None])
