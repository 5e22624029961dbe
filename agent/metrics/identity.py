"""Families that describe the agent itself: its mode and version."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moewatch import __version__

from .family import Gauge, families_of

if TYPE_CHECKING:
    from .state import MetricsState

AGENT_MODE = Gauge("moewatch_agent_mode", ("mode",), "1 for the agent's mode (observe, recommend, act).")
AGENT_INFO = Gauge("moewatch_agent_info", ("version",), "Always 1; carries the agent's version.")

FAMILIES = families_of(globals())


def init_static(state: MetricsState, mode: str) -> None:
    """Series that exist from the start: the mode and version."""
    from ..config import MODES

    for m in MODES:
        state[AGENT_MODE].set((m,), 1.0 if m == mode else 0.0)
    state[AGENT_INFO].set((__version__,), 1.0)
