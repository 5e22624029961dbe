"""Families of the watch on the engine's own rebalancing (agent/rebalance_watchdog.py): the interval the
engine is configured with, the steps since its last rebalance, whether one is overdue, and how long the
steps of each rebalance's window stalled."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .family import GROUP, Gauge, Histogram, families_of

if TYPE_CHECKING:
    from ..rebalance_watchdog import Watch
    from .state import MetricsState

INTERVAL_STEPS = Gauge(
    "moewatch_engine_rebalance_interval_steps", GROUP,
    "Forward steps between two of the engine's own rebalances, as the engine is configured (its windows' "
    "extra.rebalancing).")
ASYNCHRONOUS = Gauge(
    "moewatch_engine_rebalance_asynchronous", GROUP,
    "1 when the engine moves expert weights beside its steps, 0 when its steps wait for them.")
STEPS_SINCE = Gauge(
    "moewatch_engine_rebalance_steps_since_last", GROUP,
    "Forward steps the engine ran since the last rebalance the agent saw (or since it started watching), "
    "while every rebalance is observed.")
OVERDUE = Gauge(
    "moewatch_engine_rebalance_overdue", GROUP,
    "1 when no rebalance came in two intervals of steps while the engine stepped (its rebalancing stopped), "
    "else 0; only while every rebalance is observed.")
STEP_STALL = Histogram(
    "moewatch_engine_rebalance_step_stall_seconds", GROUP,
    "Per rebalance: how much longer the longest step of the window that carried it ran than that window's "
    "median step.", unit="seconds", buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))

FAMILIES = families_of(globals())


def record_watch(state: MetricsState, group: tuple[str, str], watch: Watch, stall_seconds: float | None) -> None:
    """The watch after one window; a settings family without a value leaves no series."""
    families = (INTERVAL_STEPS, ASYNCHRONOUS, STEPS_SINCE, OVERDUE)
    if watch.settings is None:
        for family in families:
            state[family].remove(group)
    else:
        state[INTERVAL_STEPS].set(group, watch.settings.interval_steps)
        if watch.settings.asynchronous is None:
            state[ASYNCHRONOUS].remove(group)
        else:
            state[ASYNCHRONOUS].set(group, float(watch.settings.asynchronous))
        if watch.armed:
            state[STEPS_SINCE].set(group, watch.steps_since)
            state[OVERDUE].set(group, float(watch.overdue))
        else:
            state[STEPS_SINCE].remove(group)
            state[OVERDUE].remove(group)
    if stall_seconds is not None:
        state[STEP_STALL].observe(group, [stall_seconds])


def init_group(state: MetricsState, group: tuple[str, str]) -> None:
    """The stall histogram starts empty with its group, so an alert's increase() sees the first rebalance."""
    state[STEP_STALL].observe(group, [])
