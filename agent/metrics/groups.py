"""Families of an EP group's connection and life: connected, the runtime's own drops, retirement;
and the counters every new group starts at 0."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moewatch.wire import WINDOW_LOSS_REASONS

from . import actions, engine_rebalance, rebalance_watchdog, windows
from .family import GROUP, Counter, Gauge, families_of

if TYPE_CHECKING:
    from .state import MetricsState

RUNTIME_CONNECTED = Gauge("moewatch_runtime_connected", GROUP, "1 while a runtime of the group is connected.")
RUNTIME_FRAMES_DROPPED_TOTAL = Counter(
    "moewatch_runtime_frames_dropped_total", GROUP,
    "Frames the runtime's probe dropped because the agent was absent or slow.")
RUNTIME_WINDOWS_LOST_TOTAL = Counter(
    "moewatch_runtime_windows_lost_total", (*GROUP, "reason"),
    "Windows an engine adapter could not build or send, by reason (its own cumulative count, from its "
    "heartbeats): invalid, sink_error, queue_full, send_failed, encode_error, unsent_at_close, "
    "readout_error, timer_error, other.")
GROUPS_RETIRED_TOTAL = Counter("moewatch_groups_retired_total", (), "EP groups forgotten after their runtime left.")
GROUPS_EVICTED_TOTAL = Counter(
    "moewatch_groups_evicted_total", (),
    "EP groups whose runtime had left, forgotten at max_groups to make room for a new group.")

FAMILIES = families_of(globals())

# Runtime processes whose last reported counts a group keeps (a restart brings a new pid).
WINDOWS_LOST_PROCESSES = 64


def windows_lost_growth(kept: dict[int, dict[str, int]], pid: int, reported: Any) -> dict[str, int]:
    """How much each reason grew since the process `pid` last reported its cumulative `reported`
    ({reason: count}, a heartbeat's extra "windows_lost"); `kept` (pid -> counts) is updated. A
    reason outside wire.WINDOW_LOSS_REASONS is "other" (a bounded label); a malformed report adds
    nothing. A count lower than the one kept is a new count (the process restarted its own)."""
    if not isinstance(reported, dict):
        return {}
    counts: dict[str, int] = {}
    for reason, count in reported.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            return {}
        label = reason if reason in WINDOW_LOSS_REASONS else "other"
        counts[label] = counts.get(label, 0) + count
    before = kept.pop(pid, {})
    kept[pid] = counts  # the most recent last: the oldest go first
    while len(kept) > WINDOWS_LOST_PROCESSES:
        kept.pop(next(iter(kept)))
    grown = {}
    for reason, count in counts.items():
        previous = before.get(reason, 0)
        increase = count - previous if count >= previous else count
        if increase > 0:
            grown[reason] = increase
    return grown


def init_group(state: MetricsState, group: tuple[str, str]) -> None:
    """Counters a group's alerts take rate() of start at 0, so the first event is an increase."""
    for kind in actions.ACTION_KINDS:
        for result in actions.ACTION_RESULTS:
            state[actions.ACTIONS_TOTAL].inc((*group, kind, result), 0)
    for family in (actions.ROLLBACKS_TOTAL, RUNTIME_FRAMES_DROPPED_TOTAL, windows.WINDOWS_TOTAL, windows.TOKENS_TOTAL):
        state[family].inc(group, 0)
    for reason in (*WINDOW_LOSS_REASONS, "other"):
        state[RUNTIME_WINDOWS_LOST_TOTAL].inc((*group, reason), 0)
    engine_rebalance.init_group(state, group)
    rebalance_watchdog.init_group(state, group)
