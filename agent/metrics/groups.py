"""Families of an EP group's connection and life: connected, the runtime's own drops, retirement;
and the counters every new group starts at 0."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import actions, engine_rebalance, windows
from .family import GROUP, Counter, Gauge, families_of

if TYPE_CHECKING:
    from .state import MetricsState

RUNTIME_CONNECTED = Gauge("moewatch_runtime_connected", GROUP, "1 while a runtime of the group is connected.")
RUNTIME_FRAMES_DROPPED_TOTAL = Counter(
    "moewatch_runtime_frames_dropped_total", GROUP,
    "Frames the runtime's probe dropped because the agent was absent or slow.")
GROUPS_RETIRED_TOTAL = Counter("moewatch_groups_retired_total", (), "EP groups forgotten after their runtime left.")
GROUPS_EVICTED_TOTAL = Counter(
    "moewatch_groups_evicted_total", (),
    "EP groups whose runtime had left, forgotten at max_groups to make room for a new group.")

FAMILIES = families_of(globals())


def init_group(state: MetricsState, group: tuple[str, str]) -> None:
    """Counters a group's alerts take rate() of start at 0, so the first event is an increase."""
    for kind in actions.ACTION_KINDS:
        for result in actions.ACTION_RESULTS:
            state[actions.ACTIONS_TOTAL].inc((*group, kind, result), 0)
    for family in (actions.ROLLBACKS_TOTAL, RUNTIME_FRAMES_DROPPED_TOTAL, windows.WINDOWS_TOTAL, windows.TOKENS_TOTAL):
        state[family].inc(group, 0)
    engine_rebalance.init_group(state, group)
