"""The rebalance ledger: what each rebalance of an EP group cost and what it bought, measured on the
windows around it, whoever's policy made it (the engine's own, moewatch's inside an engine, or the
agent's plan).

A rebalance splits the group's windows in three phases. `before`: the last `windows` windows before
it that no earlier rebalance's move touched; `during`: the windows its weights moved in; `after`:
the first `windows` windows once the new map is in force (fewer when the next rebalance comes
sooner). Where the windows are:
- an engine's rebalance is recorded in the window whose steps ran it (extra.engine_rebalance): that
  window is `during`. A blocking rebalance runs inside one of its steps; an asynchronous one moves
  weights beside the steps, and what it slows after that window counts in the `after` pace (it
  lowers the gain, it is never lost);
- the agent's plan on a runtime (AppliedPlan): the windows still at the old epoch that end after the
  plan was sent are `during`; the windows of the plan's epoch or later (or that start after its
  Ack, for a source that does not carry epochs) are `after`. The reference runtime moves weights
  between its steps, outside the steps' clock, and measures that wait itself (the Ack's
  stall_seconds): it is added to the stall as `stall_between_steps_seconds`.

Per entry, measured (never predicted):
- pace = seconds per step, sum of the phase windows' step_seconds over their steps;
- stall = the `during` windows' step time beyond the `before` pace (sum of step_seconds - steps x
  pace before; a move within the noise of the steps before reads 0), plus the between-steps wait;
- gain per step = pace before - pace after (negative when the steps got slower);
- horizon = steps from the end of the move to the next rebalance once it has come; until then the
  engine's configured interval (extra.rebalancing.interval_steps), else the steps seen after it;
- net = gain x horizon - stall (seconds); paid when net > 0;
- break-even = stall / gain steps (None when gain <= 0: it never pays back).
Balancedness before and after is the windows' measured balancedness (mean over windows and layers,
and over the layers the rebalance changed), ITL p50/p99 the mean over the SLO intervals that overlap
each phase. A figure the windows cannot give (no step times, no rank counts, no SLO source) is None.

`Ledger` is incremental: windows and plans are fed as they come (the agent's triage loop), an entry
is open until its `after` windows are in (or the next rebalance has begun), then settled once; the
CLI feeds recorded windows through the same object. A call that moved no slot is no rebalance and
makes no entry. Pure arithmetic in the functions below; no torch, no clocks, no files.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

DEFAULT_WINDOWS = 3  # windows before and after a rebalance (the agent uses verify.windows)
KEEP_POINTS = 512  # windows a Ledger holds for entries still open

OUTCOMES = ("paid", "did_not_pay", "unknown")
HORIZONS = ("next_rebalance", "configured_interval", "observed")
AGENT_PLAN = "agent_plan"
AGENT_ROLLBACK = "agent_rollback"
ENGINE_OWN = "engine_own"  # the engine's own algorithm (the record's engine says which)
MOEWATCH_IN_ENGINE = "moewatch_in_engine"
POLICIES = (ENGINE_OWN, MOEWATCH_IN_ENGINE, AGENT_PLAN, AGENT_ROLLBACK)
POLICY_TEXT = {ENGINE_OWN: "{engine}'s own policy", MOEWATCH_IN_ENGINE: "moewatch's policy in {engine}",
               AGENT_PLAN: "the agent's plan", AGENT_ROLLBACK: "the agent's rollback"}


def policy_label(record: Mapping[str, Any]) -> str:
    """Whose policy answered an engine rebalance record: the engine's own (`engine_own`: the algorithm
    the adapter wraps, vLLM's "default" EPLB policy or SGLang's rebalance_experts with its configured
    algorithm), also when moewatch's policy fell back to it after an error; `moewatch_in_engine` for
    moewatch's policy answering inside the engine."""
    if record.get("policy") == "engine" or record.get("fallback") is True:
        return ENGINE_OWN
    return MOEWATCH_IN_ENGINE


# --- the arithmetic -------------------------------------------------------------------------------

def pace_seconds(step_seconds: Sequence[float], steps: Sequence[int]) -> float | None:
    """Windows' summed step seconds [n] and step counts [n] -> seconds per step over all of them;
    None with no step."""
    total = int(np.sum(np.asarray(steps, dtype=np.int64))) if len(steps) else 0
    return float(np.sum(np.asarray(step_seconds, dtype=np.float64))) / total if total > 0 else None


def stall_seconds(during_step_seconds: Sequence[float], during_steps: Sequence[int], pace_before: float,
                  between_steps: float = 0.0) -> float:
    """The `during` windows' summed step seconds [D] and steps [D], the pace before (s/step), the wait
    outside the steps' clock -> the stall: max(0, sum - steps x pace) + between_steps."""
    extra = float(np.sum(np.asarray(during_step_seconds, dtype=np.float64))) - pace_before * float(
        np.sum(np.asarray(during_steps, dtype=np.int64)))
    return max(0.0, extra) + float(between_steps)


def net_seconds(gain_per_step: float, horizon_steps: int, stall: float) -> float:
    """Seconds the rebalance saved over its horizon, its stall paid: gain x horizon - stall."""
    return gain_per_step * horizon_steps - stall


def break_even_steps(stall: float, gain_per_step: float) -> float | None:
    """Steps the new map must serve to pay its stall back: stall / gain; None when gain <= 0."""
    return stall / gain_per_step if gain_per_step > 0 else None


def outcome_of(net: float | None) -> str:
    return "unknown" if net is None else ("paid" if net > 0 else "did_not_pay")


# --- what the ledger is fed -----------------------------------------------------------------------

@dataclass(frozen=True)
class WindowPoint:
    """What the ledger keeps of one window. balancedness: [L] measured, None without rank counts."""

    seq: int
    start_time: float
    end_time: float
    epoch: int
    steps: int
    step_seconds: float | None  # summed over the window's steps; None without step times
    balancedness: np.ndarray | None = None
    interval_steps: int | None = None  # the engine's configured rebalance interval, when it says


@dataclass(frozen=True)
class SloInterval:
    """One SLO scrape interval's inter-token latency quantiles (seconds), None when not measured."""

    start_time: float
    end_time: float
    itl_p50: float | None
    itl_p99: float | None


@dataclass(frozen=True)
class AppliedPlan:
    """A plan the agent applied on a runtime: sent, then acknowledged with its epoch in force."""

    epoch: int
    sent_at: float
    applied_at: float
    layers_changed: tuple[int, ...]
    slots_moved: int
    bytes_moved: float | None = None
    between_steps_stall_seconds: float = 0.0  # the Ack's stall_seconds (the runtime's wait outside its steps)
    rollback_of: int | None = None
    engine: str = ""


@dataclass
class Rebalance:
    """One rebalance placed among the windows: an engine's (window_seq: the window that carried its
    record) or the agent's plan (plan)."""

    policy: str
    engine: str
    time: float
    layers_changed: tuple[int, ...] | None
    slots_moved: int | None
    bytes_moved: float | None
    window_seq: int | None = None
    plan: AppliedPlan | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def phase(self, p: WindowPoint) -> str:
        """before | during | after, for one window."""
        if self.plan is None:
            return "before" if p.seq < self.window_seq else ("during" if p.seq == self.window_seq else "after")
        if p.end_time <= self.plan.sent_at:
            return "before"
        if p.epoch >= self.plan.epoch or p.start_time >= self.plan.applied_at:
            return "after"
        return "during"

    def begun(self, p: WindowPoint) -> bool:
        return self.phase(p) != "before"


def rebalances_of(records: Iterable[Any], window_seq: int, window_time: float) -> list[Rebalance]:
    """The rebalance an engine window's records (extra.engine_rebalance) describe: none, or one. The
    windows cannot tell apart several calls in one window, so they are one entry: the policy of the
    last call (whose map the window ends with), their layers joined, slots and bytes added (unknown
    when a call does not say, e.g. a fallback to the engine's own algorithm). A malformed record, or
    a call that moved no slot, counts for nothing."""
    found: Rebalance | None = None
    for record in records:
        if not isinstance(record, dict) or not isinstance(record.get("engine"), str):
            continue
        layers, slots, nbytes = _moved(record)
        if slots == 0:
            continue
        when = _number(record.get("time"))
        recorded = {k: record[k] for k in ("call", "digest", "balancedness_before", "balancedness_after",
                                           "predicted_stall_seconds", "error") if k in record}
        if found is None:
            found = Rebalance(policy_label(record), record["engine"], window_time if when is None else when, layers,
                              slots, nbytes, window_seq=window_seq, detail={"calls": 1, "recorded": recorded})
            continue
        found.policy = policy_label(record)
        found.layers_changed = _join(found.layers_changed, layers)
        found.slots_moved = None if found.slots_moved is None or slots is None else found.slots_moved + slots
        found.bytes_moved = None if found.bytes_moved is None or nbytes is None else found.bytes_moved + nbytes
        found.detail["calls"] += 1
        found.detail["recorded"] = recorded
    return [] if found is None else [found]


def _moved(record: dict[str, Any]) -> tuple[tuple[int, ...] | None, int | None, float | None]:
    """(layers changed, slots moved, bytes moved) a record says, each None when it does not."""
    if record.get("fallback") is True:
        return None, None, None
    if record.get("policy") == "engine":
        layers = record.get("layers_changed")
        layers = tuple(int(x) for x in layers if _index(x)) if isinstance(layers, list) else None
        slots = _number(record.get("slots_moved"))
        return layers, None if slots is None else int(slots), _number(record.get("bytes_moved"))
    from .planner.rebalance import CHANGED  # the planner's reasons for a layer whose row changed

    reasons = record.get("layers_by_reason")
    layers = None
    if isinstance(reasons, dict):
        layers = tuple(sorted(int(x) for reason, ls in reasons.items() if reason in CHANGED and isinstance(ls, list)
                              for x in ls if _index(x)))
    slots = _number(record.get("experts_moved"))
    return layers, None if slots is None else int(slots), _number(record.get("bytes_moved"))


def _index(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
        return None
    return float(x)


def _join(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> tuple[int, ...] | None:
    return None if a is None or b is None else tuple(sorted(set(a) | set(b)))


# --- measuring one rebalance ----------------------------------------------------------------------

def _mean(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(known)) if known else None


def measured_balancedness(points: Sequence[WindowPoint], layers: Sequence[int] | None = None) -> float | None:
    """Mean over the windows of their measured balancedness, over all layers or over `layers`."""
    values = []
    for p in points:
        if p.balancedness is None:
            continue
        b = p.balancedness if layers is None else p.balancedness[[x for x in layers if x < len(p.balancedness)]]
        if len(b):
            values.append(float(b.mean()))
    return _mean(values)


def itl_over(intervals: Sequence[SloInterval], start: float | None, end: float | None) -> tuple[float | None, float | None]:
    """(ITL p50, p99): means over the SLO intervals that overlap [start, end]."""
    if start is None or end is None:
        return None, None
    over = [s for s in intervals if s.end_time > start and s.start_time < end]
    return _mean(s.itl_p50 for s in over), _mean(s.itl_p99 for s in over)


def _span(points: Sequence[WindowPoint]) -> tuple[float | None, float | None]:
    return (points[0].start_time, points[-1].end_time) if points else (None, None)


def measure(r: Rebalance, before: Sequence[WindowPoint], during: Sequence[WindowPoint],
            after: Sequence[WindowPoint], horizon: tuple[int, str] | None,
            slo: Sequence[SloInterval] = (), settled: bool = True) -> dict[str, Any]:
    """One ledger entry from the rebalance and its windows by phase; horizon: (steps, how it was
    known: next_rebalance | configured_interval | observed), None when unknown."""
    pace = {name: pace_seconds([p.step_seconds for p in ps if p.step_seconds is not None],
                               [p.steps for p in ps if p.step_seconds is not None])
            for name, ps in (("before", before), ("during", during), ("after", after))}
    between = r.plan.between_steps_stall_seconds if r.plan is not None else 0.0
    stall = gain = net = even = None
    if pace["before"] is not None and all(p.step_seconds is not None for p in during):
        stall = stall_seconds([p.step_seconds for p in during], [p.steps for p in during], pace["before"], between)
    if pace["before"] is not None and pace["after"] is not None:
        gain = pace["before"] - pace["after"]
    if stall is not None and gain is not None:
        even = break_even_steps(stall, gain)
        if horizon is not None:
            net = net_seconds(gain, horizon[0], stall)
    spans = {"before": _span(before), "during": _span(during), "after": _span(after)}
    if r.plan is not None and not during:
        spans["during"] = (r.plan.sent_at, r.plan.applied_at)
    itl = {name: itl_over(slo, *span) for name, span in spans.items()}
    layers = r.layers_changed
    entry = {
        "policy": r.policy, "engine": r.engine, "rebalanced_at": r.time, "settled": settled,
        "layers_changed": None if layers is None else list(layers), "slots_moved": r.slots_moved,
        "bytes_moved": r.bytes_moved,
        "windows": {"before": len(before), "during": len(during), "after": len(after)},
        "balancedness_before": measured_balancedness(before), "balancedness_after": measured_balancedness(after),
        "balancedness_changed_layers_before": None if not layers else measured_balancedness(before, layers),
        "balancedness_changed_layers_after": None if not layers else measured_balancedness(after, layers),
        **{f"step_seconds_{name}": value for name, value in pace.items()},
        **{f"itl_p50_seconds_{name}": itl[name][0] for name in itl},
        **{f"itl_p99_seconds_{name}": itl[name][1] for name in itl},
        "stall_seconds": stall, "stall_between_steps_seconds": between if r.plan is not None else None,
        "gain_seconds_per_step": gain,
        "horizon_steps": None if horizon is None else horizon[0], "horizon": None if horizon is None else horizon[1],
        "net_seconds": net, "break_even_steps": even, "outcome": outcome_of(net),
    }
    if r.plan is not None:
        entry["plan"] = {"epoch": r.plan.epoch, "sent_at": r.plan.sent_at, "applied_at": r.plan.applied_at,
                         "rollback_of": r.plan.rollback_of}
    entry.update(r.detail)
    return entry


# --- the incremental ledger -----------------------------------------------------------------------

class Ledger:
    """One EP group's rebalances, fed window by window (and plan by plan) in order; each add returns the
    entries it settled. Not thread-safe: one feeder (the agent's triage job, or the CLI)."""

    def __init__(self, windows: int = DEFAULT_WINDOWS, keep: int = KEEP_POINTS):
        if windows < 1:
            raise ValueError(f"windows: must be at least 1, got {windows}")
        self.windows = windows
        self.points: deque[WindowPoint] = deque(maxlen=max(keep, 4 * windows + 4))
        self.slo: deque[SloInterval] = deque(maxlen=max(keep, 4 * windows + 4))
        self.open: list[Rebalance] = []
        self.previous: Rebalance | None = None  # the latest settled one: the `before` windows start after it
        self._seq = 0

    def add_window(self, start_time: float, end_time: float, epoch: int, steps: int,
                   step_seconds: Sequence[float] | None, balancedness: np.ndarray | None,
                   records: Sequence[Any] = (), interval_steps: int | None = None,
                   slo: SloInterval | None = None) -> list[dict[str, Any]]:
        """One window in order: step_seconds [S] (None without step times), balancedness [L] measured
        (None without rank counts), the engine rebalance records it carried, the engine's configured
        interval, the SLO interval stamped on it."""
        point = WindowPoint(self._seq, float(start_time), float(end_time), int(epoch), int(steps),
                            None if step_seconds is None else float(np.sum(step_seconds)),
                            None if balancedness is None else np.asarray(balancedness, dtype=np.float64),
                            interval_steps)
        self._seq += 1
        self.points.append(point)
        if slo is not None and (not self.slo or (self.slo[-1].start_time, self.slo[-1].end_time)
                                != (slo.start_time, slo.end_time)):
            self.slo.append(slo)
        self.open.extend(rebalances_of(records, point.seq, point.end_time))
        return self._settle()

    def add_plan(self, plan: AppliedPlan) -> list[dict[str, Any]]:
        """The agent's applied plan (as soon as its Ack is in, even after windows of its epoch came)."""
        policy = AGENT_ROLLBACK if plan.rollback_of is not None else AGENT_PLAN
        if plan.slots_moved <= 0:
            return []
        self.open.append(Rebalance(policy, plan.engine, plan.sent_at, tuple(plan.layers_changed), plan.slots_moved,
                                   plan.bytes_moved, plan=plan, detail={"epoch": plan.epoch}))
        self.open.sort(key=self._start_key)
        return self._settle()

    def finish(self) -> list[dict[str, Any]]:
        """The entries still open (end of the recorded windows), measured on what there is, marked
        settled false."""
        out = [self._entry(r, i, settled=False) for i, r in enumerate(self.open)]
        self.open = []
        return out

    def _start_key(self, r: Rebalance) -> float:
        """Where a rebalance begins, in window order: its window, or the first window it did not precede."""
        if r.plan is None:
            return float(r.window_seq)
        begun = [p.seq for p in self.points if r.begun(p)]
        return float(begun[0]) - 0.5 if begun else float(self._seq) - 0.5

    def _phases(self, r: Rebalance, previous: Rebalance | None, following: Rebalance | None):
        before = [p for p in self.points if r.phase(p) == "before" and (previous is None or previous.phase(p) == "after")]
        during = [p for p in self.points if r.phase(p) == "during"]
        after = [p for p in self.points if r.phase(p) == "after" and (following is None or following.phase(p) == "before")]
        return before[-self.windows:], during, after

    def _entry(self, r: Rebalance, index: int, settled: bool) -> dict[str, Any]:
        previous = self.previous if index == 0 else self.open[index - 1]
        following = self.open[index + 1] if index + 1 < len(self.open) else None
        before, during, all_after = self._phases(r, previous, following)
        after = all_after[:self.windows]
        horizon = None
        if following is not None and self.points and following.begun(self.points[-1]):
            horizon = (sum(p.steps for p in all_after), "next_rebalance")
        else:
            interval = next((p.interval_steps for p in reversed(during or before) if p.interval_steps), None)
            if interval is not None and r.plan is None:
                horizon = (int(interval), "configured_interval")
            elif all_after:
                horizon = (sum(p.steps for p in all_after), "observed")
        return measure(r, before, during, after, horizon, list(self.slo), settled)

    def _settle(self) -> list[dict[str, Any]]:
        settled = []
        while self.open:
            r = self.open[0]
            following = self.open[1] if len(self.open) > 1 else None
            _, _, after = self._phases(r, self.previous, following)
            next_begun = following is not None and bool(self.points) and following.begun(self.points[-1])
            if len(after) < self.windows and not next_begun:
                break
            settled.append(self._entry(r, 0, settled=True))
            self.previous = self.open.pop(0)
        return settled


# --- from a Window ---------------------------------------------------------------------------------

def bounded_policy(policy: str) -> str:
    """A policy as a metric label: one of POLICIES, anything else `other`."""
    return policy if policy in POLICIES else "other"


def slo_interval(extra: Mapping[str, Any]) -> SloInterval | None:
    """The SLO interval a window's extra.slo carries (moewatch/slo.py), None without one."""
    from .slo import SLO_KEY

    slo = extra.get(SLO_KEY)
    if not isinstance(slo, dict) or not isinstance(slo.get("quantiles"), dict):
        return None
    start, end = _number(slo.get("start_time")), _number(slo.get("end_time"))
    if start is None or end is None:
        return None
    itl = slo["quantiles"].get("itl") or {}
    itl = itl if isinstance(itl, dict) else {}
    return SloInterval(start, end, _number(itl.get("p50")), _number(itl.get("p99")))


def add_window_of(ledger: Ledger, window: Any) -> list[dict[str, Any]]:
    """Feed one moewatch Window (telemetry.Window) to a ledger: its step times, measured balancedness,
    the rebalance records and settings of its extra, its SLO interval."""
    from .engine_rebalancing import RebalancingSettings
    from .telemetry import balancedness

    try:
        settings = RebalancingSettings.from_extra(window.extra)
    except (TypeError, ValueError):  # the runtime's input: a malformed one says no interval
        settings = None
    records = window.extra.get("engine_rebalance")
    return ledger.add_window(window.start_time, window.end_time, window.epoch, window.steps, window.step_seconds,
                             balancedness(window), records if isinstance(records, list) else (),
                             None if settings is None else settings.interval_steps, slo_interval(window.extra))


# --- reading entries back -------------------------------------------------------------------------

def whose_policy(e: Mapping[str, Any]) -> str:
    """Whose policy made an entry, in words (the CLI's line and `moewatch top`)."""
    return POLICY_TEXT.get(e.get("policy"), str(e.get("policy"))).format(engine=e.get("engine") or "the engine")


def format_entry(e: Mapping[str, Any]) -> str:
    """One line for an operator: when, whose policy, what moved, stall, gain, net, break-even, verdict."""
    import time as _time

    def num(value, spec: str, scale: float = 1.0) -> str:
        return "?" if value is None else format(value * scale, spec)

    when = _time.strftime("%Y-%m-%d %H:%M:%S", _time.gmtime(e["rebalanced_at"])) if e.get("rebalanced_at") is not None else "?"
    layers = e.get("layers_changed")
    group = f"{e['model']}/{e['ep_group']} " if e.get("model") else ""
    even = e.get("break_even_steps")
    whose = whose_policy(e)
    text = (f"{when} {group}{whose}: {'?' if layers is None else len(layers)} layers, "
            f"{num(e.get('slots_moved'), '.0f')} slots"
            + ("" if e.get("bytes_moved") is None else f" ({e['bytes_moved'] / 1e6:.1f} MB)")
            + f"; balancedness {num(e.get('balancedness_before'), '.3f')} -> {num(e.get('balancedness_after'), '.3f')}"
            f"; step {num(e.get('step_seconds_before'), '.2f', 1e3)} -> {num(e.get('step_seconds_after'), '.2f', 1e3)} ms"
            f"; stall {num(e.get('stall_seconds'), '.3f')} s, gain {num(e.get('gain_seconds_per_step'), '.3f', 1e3)} "
            f"ms/step, net {num(e.get('net_seconds'), '+.3f')} s over {num(e.get('horizon_steps'), '.0f')} steps"
            f" ({e.get('horizon') or '?'}), break-even {'never' if even is None and e.get('gain_seconds_per_step') is not None else num(even, '.1f')} steps"
            f": {e.get('outcome', 'unknown').replace('_', ' ')}" + ("" if e.get("settled", True) else " (open)"))
    return text
