"""Families of the rebalance ledger (moewatch/ledger.py, fed by agent/ledger.py): per settled rebalance,
by whose policy made it, what it stalled, what it gained per step, its net seconds and break-even,
and how many paid."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moewatch.ledger import OUTCOMES, POLICIES, bounded_policy

from .family import GROUP, Counter, Gauge, families_of

if TYPE_CHECKING:
    from .state import MetricsState

POLICY = (*GROUP, "policy")

ENTRIES_TOTAL = Counter(
    "moewatch_rebalance_ledger_entries_total", (*POLICY, "outcome"),
    "Rebalances the ledger settled, by whose policy made them (engine_own: the engine's own algorithm, "
    "moewatch_in_engine: moewatch's policy inside the engine, agent_plan, agent_rollback) and outcome (paid: "
    "net seconds > 0, did_not_pay, unknown: the windows lacked step times).")
STALL = Gauge(
    "moewatch_rebalance_ledger_stall_seconds", POLICY,
    "The latest settled rebalance's stall: the step time of the windows its weights moved in beyond the pace "
    "before it, plus the wait between steps a runtime reports.", unit="seconds")
STALL_TOTAL = Counter(
    "moewatch_rebalance_ledger_stall_seconds_total", POLICY,
    "Stall of every settled rebalance, summed.", unit="seconds")
GAIN_PER_STEP = Gauge(
    "moewatch_rebalance_ledger_gain_per_step_seconds", POLICY,
    "The latest settled rebalance's gain per step: seconds per step before it minus after it (negative: the "
    "steps got slower).", unit="seconds")
NET = Gauge(
    "moewatch_rebalance_ledger_net_seconds", POLICY,
    "The latest settled rebalance's net: gain per step x steps until the next rebalance (or the configured "
    "interval, or the steps seen since) - stall.", unit="seconds")
BREAK_EVEN_STEPS = Gauge(
    "moewatch_rebalance_ledger_break_even_steps", POLICY,
    "Steps the latest settled rebalance's new map must serve to pay back its stall (absent when it gained "
    "nothing: it never pays back).")
HORIZON_STEPS = Gauge(
    "moewatch_rebalance_ledger_horizon_steps", POLICY,
    "Steps the latest settled rebalance's net was counted over.")
BALANCEDNESS = Gauge(
    "moewatch_rebalance_ledger_balancedness_ratio", (*POLICY, "phase"),
    "Measured balancedness (mean over windows and layers) before and after the latest settled rebalance.",
    unit="ratio")
STEP_SECONDS = Gauge(
    "moewatch_rebalance_ledger_step_seconds", (*POLICY, "phase"),
    "Seconds per step in the windows before, during and after the latest settled rebalance.", unit="seconds")
LAST_TIMESTAMP = Gauge(
    "moewatch_rebalance_ledger_last_timestamp_seconds", POLICY,
    "When the latest settled rebalance happened (unix seconds).", unit="seconds")

FAMILIES = families_of(globals())

LATEST = (STALL, GAIN_PER_STEP, NET, BREAK_EVEN_STEPS, HORIZON_STEPS, LAST_TIMESTAMP)
KEYS = {STALL: "stall_seconds", GAIN_PER_STEP: "gain_seconds_per_step", NET: "net_seconds",
        BREAK_EVEN_STEPS: "break_even_steps", HORIZON_STEPS: "horizon_steps", LAST_TIMESTAMP: "rebalanced_at"}


def record_entry(state: MetricsState, group: tuple[str, str], entry: dict[str, Any]) -> None:
    """One settled entry: counted by policy and outcome; its figures replace the policy's latest (a figure
    the windows could not give removes the series rather than keep an older rebalance's)."""
    policy = bounded_policy(entry["policy"])
    labels = (*group, policy)
    outcome = entry["outcome"] if entry["outcome"] in OUTCOMES else "unknown"
    state[ENTRIES_TOTAL].inc((*labels, outcome))
    if entry.get("stall_seconds") is not None:
        state[STALL_TOTAL].inc(labels, entry["stall_seconds"])
    for family in LATEST:
        _set_or_remove(state, family, labels, entry.get(KEYS[family]))
    for family, prefix, phases in ((BALANCEDNESS, "balancedness", ("before", "after")),
                                   (STEP_SECONDS, "step_seconds", ("before", "during", "after"))):
        for phase in phases:
            _set_or_remove(state, family, (*labels, phase), entry.get(f"{prefix}_{phase}"))


def _set_or_remove(state: MetricsState, family: Gauge, labels: tuple[str, ...], value: float | None) -> None:
    if value is None:
        state[family].remove(labels)
    else:
        state[family].set(labels, float(value))


def init_group(state: MetricsState, group: tuple[str, str]) -> None:
    """The entries counters start at 0 with the group, so an alert's increase() sees its first rebalance
    (MoewatchRebalancesNotPaying)."""
    state[ENTRIES_TOTAL].inc_many([((*group, policy, outcome), 0) for policy in POLICIES for outcome in OUTCOMES])
