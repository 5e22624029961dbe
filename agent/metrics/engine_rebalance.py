"""Families of the engine's own rebalancing (vLLM's or SGLang's EPLB), whoever's policy answered it:
the records the engine adapter carries in its windows (extra.engine_rebalance: moewatch's policy's
decisions and fallbacks, and the calls of the engine's own policy the adapter records with moewatch's
off), and the agent's check of each rebalance on the next window."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from moewatch.integrations import registry
from moewatch.planner.rebalance import OUTCOMES as DECISION_OUTCOMES
from moewatch.telemetry import Window

from .family import GROUP, Counter, Gauge, families_of

if TYPE_CHECKING:
    from .state import MetricsState

CALLS_TOTAL = Counter(
    "moewatch_engine_rebalance_calls_total", (*GROUP, "engine", "result"),
    "Engine rebalance calls answered by moewatch's policy (result decided), after an error by the "
    "engine's own algorithm (result fallback), or by the engine's own policy with moewatch's off "
    "(result engine_own).")
LAYERS_TOTAL = Counter(
    "moewatch_engine_rebalance_layers_total", (*GROUP, "outcome"),
    "Layers per engine rebalance by outcome (moved, moved_less, placed, kept_no_better, kept_not_paying, "
    "kept_idle, placed_static, kept_static).")
EXPERTS_MOVED_TOTAL = Counter(
    "moewatch_engine_rebalance_experts_moved_total", GROUP,
    "Slots whose expert the engine's rebalances changed (moewatch's policy's decisions and the engine's own "
    "policy's recorded calls).")
BALANCEDNESS = Gauge(
    "moewatch_engine_rebalance_balancedness_ratio", (*GROUP, "phase"),
    "Balancedness of the latest engine rebalance on the load it was solved for: before, proposed (moewatch's "
    "planner's) and after (what the gate kept, or what the engine's own policy answered).", unit="ratio")
PREDICTED_STALL = Gauge(
    "moewatch_engine_rebalance_predicted_stall_seconds", GROUP,
    "Predicted stall of the latest engine rebalance's moves.", unit="seconds")
SOLVE_SECONDS = Gauge(
    "moewatch_engine_rebalance_solve_seconds", GROUP,
    "Seconds the latest engine rebalance call took inside the engine.", unit="seconds")
VERDICTS_TOTAL = Counter(
    "moewatch_engine_rebalance_verdicts_total", (*GROUP, "verdict"),
    "Engine rebalances checked on the next window: worse (a moved layer's measured balancedness fell by "
    "more than verify.rollback_balancedness_drop) or not_worse.")
LAYERS_WORSE_TOTAL = Counter(
    "moewatch_engine_rebalance_layers_worse_total", GROUP,
    "Layers an engine rebalance made worse (measured balancedness).")

FAMILIES = families_of(globals())

OUTCOMES = tuple(DECISION_OUTCOMES.values())  # the planner's names: a bounded label set
VERDICTS = ("worse", "not_worse")


def records_of(w: Window) -> list[dict[str, Any]]:
    """The engine rebalance records a window carries (extra.engine_rebalance), the well-formed ones:
    the runtime's input, so anything else in the list is left out rather than trusted."""
    records = w.extra.get("engine_rebalance")
    if not isinstance(records, list):
        return []
    return [r for r in records if isinstance(r, dict) and isinstance(r.get("engine"), str)
            and (r.get("fallback") is True or isinstance(r.get("layer_outcomes"), dict) or is_engine_own(r))]


def is_engine_own(record: dict[str, Any]) -> bool:
    """A call of the engine's own policy that the adapter recorded with moewatch's policy off
    (moewatch.engine_rebalancing.observed_rebalance: layers_changed and slots_moved, no layer outcomes)."""
    return record.get("policy") == "engine" and isinstance(record.get("layers_changed"), list)


def call_result(record: dict[str, Any]) -> str:
    """The calls_total `result` of a well-formed record (records_of)."""
    if record.get("fallback") is True:
        return "fallback"
    return "engine_own" if is_engine_own(record) else "decided"


def record_rebalances(state: MetricsState, group: tuple[str, str], records: list[dict[str, Any]]) -> None:
    """Count the engine's rebalance calls and their layers; the latest decision's predictions as gauges."""
    for r in records:
        result = call_result(r)
        # A bounded label set: the registered integrations' runtimes, anything else "other".
        engine = r["engine"] if registry.covering(r["engine"]) is not None else "other"
        state[CALLS_TOTAL].inc((*group, engine, result))
        if result == "fallback":
            continue
        for outcome in OUTCOMES if result == "decided" else ():
            count = record_number(r["layer_outcomes"].get(outcome, 0))
            if count:
                state[LAYERS_TOTAL].inc((*group, outcome), count)
        moved = record_number(r.get("experts_moved" if result == "decided" else "slots_moved"))
        if moved:
            state[EXPERTS_MOVED_TOTAL].inc(group, moved)
        for phase in ("before", "proposed", "after"):
            value = r.get(f"balancedness_{phase}")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0:
                state[BALANCEDNESS].set((*group, phase), value)
        for family, key in ((PREDICTED_STALL, "predicted_stall_seconds"), (SOLVE_SECONDS, "solve_seconds")):
            value = record_number(r.get(key))
            if value is not None:
                state[family].set(group, value)


def init_group(state: MetricsState, group: tuple[str, str]) -> None:
    """The counters alerts take rate() of start at 0."""
    state[LAYERS_WORSE_TOTAL].inc(group, 0)
    for verdict in VERDICTS:
        state[VERDICTS_TOTAL].inc((*group, verdict), 0)


def record_number(value: Any) -> float | None:
    """A finite, non-negative number from a record, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)
